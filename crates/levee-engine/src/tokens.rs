//! Deterministic token accounting and pseudo-text.
//!
//! The engine has no tokenizer. It counts prompt tokens with one documented rule that the
//! gateway and the simulator can reproduce exactly ([`estimate_prompt_tokens`],
//! [`estimate_chat_prompt_tokens`]), and it generates completions one token at a time, each
//! token a short word, so `usage.completion_tokens` is exactly the number of tokens streamed.

/// Characters per prompt token: the usual rule of thumb for English with BPE tokenizers.
pub const CHARS_PER_TOKEN: usize = 4;

/// Tokens added per chat message for its role and delimiters (OpenAI documents ~3–4).
pub const CHAT_TOKENS_PER_MESSAGE: u32 = 4;

/// Tokens added once per chat prompt for the assistant's reply header.
pub const CHAT_TOKENS_PER_PROMPT: u32 = 2;

/// Prompt tokens of a plain text: `ceil(chars / 4)` counting Unicode scalar values, so the
/// empty string is 0 tokens and any non-empty text is at least 1.
pub fn estimate_prompt_tokens(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Prompt tokens of a chat: for each message `4 + estimate_prompt_tokens(content)`, plus 2
/// for the whole prompt. `messages` yields the text content of each message (the text parts
/// joined, when the content is an array of parts).
pub fn estimate_chat_prompt_tokens<'a>(messages: impl IntoIterator<Item = &'a str>) -> u32 {
    messages
        .into_iter()
        .map(|content| CHAT_TOKENS_PER_MESSAGE.saturating_add(estimate_prompt_tokens(content)))
        .fold(CHAT_TOKENS_PER_PROMPT, u32::saturating_add)
}

/// A stable 64-bit hash (FNV-1a) of the prompt text: the seed of its completion, so the same
/// prompt always yields the same completion on every engine and every run.
pub fn prompt_seed(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64: a tiny, well-mixed step from a seed to a pseudo-random value.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The natural completion length (where the simulated model would emit end-of-sequence) of a
/// prompt with this seed: uniform in `min..=max`, fixed by the seed.
pub fn natural_completion_tokens(seed: u64, min: u32, max: u32) -> u32 {
    let (lo, hi) = if min <= max { (min, max) } else { (max, min) };
    let span = u64::from(hi - lo) + 1;
    lo + u32::try_from(mix(seed) % span).unwrap_or(0)
}

/// How many tokens a request generates, given its prompt seed and options.
///
/// `completion_tokens = min(max_tokens, max(natural, min_tokens))`, where `natural` is
/// [`natural_completion_tokens`]; with `ignore_eos` (a vLLM extension) it is `max_tokens`.
/// The finish reason is `"length"` when the result equals `max_tokens`, else `"stop"`.
pub fn completion_tokens(
    seed: u64,
    max_tokens: u32,
    min_tokens: u32,
    ignore_eos: bool,
    output_min: u32,
    output_max: u32,
) -> u32 {
    if ignore_eos {
        return max_tokens;
    }
    natural_completion_tokens(seed, output_min, output_max)
        .max(min_tokens)
        .min(max_tokens)
}

/// Tokens the pseudo-text is drawn from: a space and a word each, so joined text reads as
/// words and `text.split_whitespace().count()` equals the token count.
const WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with",
    " be", " by", " on", " not", " he", " this", " are", " or", " his", " from", " at", " which",
    " but", " have", " an", " had", " they", " you", " were", " their", " one", " all", " we",
    " can", " her", " has", " there", " been", " if", " more", " when", " will", " would", " who",
    " so", " no", " river", " levee", " water", " flood", " bank", " stone", " gate", " rain",
    " field", " road", " town", " hill", " light", " wind", " cloud", " boat",
];

/// The text of token `index` of the completion seeded by `seed`: `" word"`.
pub fn token_text(seed: u64, index: u32) -> &'static str {
    let i = mix(seed ^ u64::from(index).wrapping_mul(0x9e37_79b9)) % WORDS.len() as u64;
    // The modulo keeps `i` in range; the fallback is never taken.
    WORDS
        .get(usize::try_from(i).unwrap_or(0))
        .copied()
        .unwrap_or(" the")
}

/// The whole completion text of `n` tokens seeded by `seed`.
pub fn completion_text(seed: u64, n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 6);
    for i in 0..n {
        s.push_str(token_text(seed, i));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_are_ceil_chars_over_four() {
        assert_eq!(estimate_prompt_tokens(""), 0);
        assert_eq!(estimate_prompt_tokens("a"), 1);
        assert_eq!(estimate_prompt_tokens("abcd"), 1);
        assert_eq!(estimate_prompt_tokens("abcde"), 2);
        // Characters, not bytes: four 3-byte characters are one token.
        assert_eq!(estimate_prompt_tokens("水水水水"), 1);
        assert_eq!(estimate_prompt_tokens(&"x".repeat(400)), 100);
    }

    #[test]
    fn chat_tokens_add_per_message_overhead() {
        assert_eq!(estimate_chat_prompt_tokens([]), 2);
        assert_eq!(estimate_chat_prompt_tokens(["hello"]), 2 + 4 + 2);
        assert_eq!(estimate_chat_prompt_tokens(["abcd", ""]), 2 + (4 + 1) + 4);
    }

    #[test]
    fn completion_length_is_deterministic_and_capped() {
        let seed = prompt_seed("Tell me about levees");
        let n = natural_completion_tokens(seed, 10, 20);
        assert!((10..=20).contains(&n));
        assert_eq!(n, natural_completion_tokens(seed, 10, 20));
        assert_eq!(completion_tokens(seed, 5, 0, false, 10, 20), 5);
        assert_eq!(completion_tokens(seed, 1000, 0, false, 10, 20), n);
        assert_eq!(completion_tokens(seed, 1000, 0, true, 10, 20), 1000);
        assert_eq!(completion_tokens(seed, 1000, 50, false, 10, 20), 50);
        // Different prompts spread over the range.
        let lens: std::collections::HashSet<u32> = (0..200)
            .map(|i| natural_completion_tokens(prompt_seed(&format!("p{i}")), 10, 20))
            .collect();
        assert!(lens.len() > 5, "{lens:?}");
    }

    #[test]
    fn text_has_one_word_per_token() {
        let text = completion_text(42, 17);
        assert_eq!(text.split_whitespace().count(), 17);
        assert!(text.starts_with(' '));
        assert_eq!(text, completion_text(42, 17));
        assert_ne!(completion_text(42, 17), completion_text(43, 17));
    }
}
