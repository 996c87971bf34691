//! Counting a request's prompt tokens before it is admitted: exactly, with the model's own
//! tokenizer when one is configured (a Hugging Face `tokenizer.json`), or by the fallback
//! rule: one token per CJK character (Han, Kana, Hangul: BPE tokenizers trained mostly on
//! other text give each of them a token or more) and one per 4 other characters.
//!
//! Both count chat prompts the same way around the text: 4 tokens per message (role and
//! delimiters) and 2 per prompt (the reply header), as OpenAI documents for its chat format.
//! The fallback is an estimate; the error of either is exported as
//! `levee_prompt_estimate_ratio` (estimate ÷ the backend's own count) so an operator sees it.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// Tokens per chat message for its role and delimiters.
const TOKENS_PER_MESSAGE: u64 = 4;
/// Tokens per chat prompt for the reply header.
const TOKENS_PER_CHAT: u64 = 2;
/// Characters per token of the fallback rule.
const CHARS_PER_TOKEN: u64 = 4;

/// The text of a request's prompt, as read from its body (borrowed from it where the body
/// holds the text as it is).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PromptText<'a> {
    /// Each message's text (chat), or each prompt string (completions).
    pub parts: Vec<Cow<'a, str>>,
    /// Whether it is a chat (`messages`) rather than a plain `prompt`.
    pub chat: bool,
    /// Tokens given as ids (a `prompt` of integers): counted as they are.
    pub token_ids: u64,
    /// Tool definitions (`tools`, `functions`) as their JSON text: counted as text.
    pub tools: Option<Cow<'a, str>>,
    /// Image parts of chat messages: [`TOKENS_PER_IMAGE`] each.
    pub images: u64,
}

/// Tokens counted per image part of a chat message. What an image costs depends on the
/// model and the image (576 for a 336-pixel image in LLaVA-1.5, hundreds to thousands in
/// models that tile large images); this is a starting point that the lane's prompt
/// correction adjusts to what the engine reports.
pub const TOKENS_PER_IMAGE: u64 = 768;

/// Whether `c` is a CJK character (Han, Kana, Hangul, CJK and full-width punctuation).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x1100..=0x11FF | 0x2E80..=0x9FFF | 0xA960..=0xA97F | 0xAC00..=0xD7FF
            | 0xF900..=0xFAFF | 0xFE30..=0xFE4F | 0xFF00..=0xFFEF | 0x20000..=0x3FFFF)
}

/// One walk over a text's characters: what the fallback counts and what the text's kind is
/// judged by.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    /// CJK characters.
    cjk: u64,
    /// Every other character, whitespace included.
    non_cjk: u64,
    /// ASCII punctuation and digits.
    symbols: u64,
    /// Other characters that are not whitespace (letters, mostly).
    letters: u64,
}

impl Tally {
    fn of(text: &str) -> Tally {
        let mut t = Tally::default();
        for c in text.chars() {
            if c.is_ascii() {
                // Most prompt text: no CJK range to test, ASCII's own whitespace rule.
                t.non_cjk += 1;
                let b = c as u8;
                if b.is_ascii_punctuation() || b.is_ascii_digit() {
                    t.symbols += 1;
                } else if !(b.is_ascii_whitespace() || b == 0x0B) {
                    t.letters += 1;
                }
            } else {
                t.count(c);
            }
        }
        t
    }

    /// Counts one character of any kind.
    fn count(&mut self, c: char) {
        if is_cjk(c) {
            self.cjk += 1;
            return;
        }
        self.non_cjk += 1;
        if c.is_ascii_punctuation() || c.is_ascii_digit() {
            self.symbols += 1;
        } else if !c.is_whitespace() {
            self.letters += 1;
        }
    }

    /// The fallback's count: the CJK characters, plus ⌈other characters / 4⌉.
    fn fallback_tokens(&self) -> u64 {
        self.cjk + self.non_cjk.div_ceil(CHARS_PER_TOKEN)
    }

    fn add(&mut self, o: Tally) {
        self.cjk += o.cjk;
        self.non_cjk += o.non_cjk;
        self.symbols += o.symbols;
        self.letters += o.letters;
    }

    /// What the text is mostly made of, for the lane's prompt correction: each kind is
    /// corrected by its own learned factor.
    fn kind(&self) -> levee_policy::TextKind {
        levee_policy::TextKind::of_counts(self.cjk, self.symbols, self.letters)
    }
}

/// How prompt tokens are counted for one model.
#[derive(Clone, Default)]
pub enum TokenCounter {
    /// The fallback: each CJK character, plus ⌈other characters / 4⌉, per part.
    #[default]
    CharsPerToken,
    /// The model's tokenizer.
    Tokenizer(Arc<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenCounter::CharsPerToken => f.write_str("CharsPerToken"),
            TokenCounter::Tokenizer(_) => f.write_str("Tokenizer"),
        }
    }
}

impl TokenCounter {
    /// Loads a `tokenizer.json`. The error says what is wrong with the file.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        tokenizers::Tokenizer::from_file(path)
            .map(|t| TokenCounter::Tokenizer(Arc::new(t)))
            .map_err(|e| {
                format!(
                    "cannot load {} as a Hugging Face tokenizer.json: {e}",
                    path.display()
                )
            })
    }

    /// Prompt tokens of `prompt`, and what its text (parts and tools) is mostly made of:
    /// one walk over its characters for both.
    pub fn measure(&self, prompt: &PromptText) -> (u64, levee_policy::TextKind) {
        let mut all = Tally::default();
        let mut text_tokens = 0u64;
        for p in prompt.parts.iter().chain(prompt.tools.iter()) {
            let tally = Tally::of(p);
            all.add(tally);
            text_tokens += match self {
                TokenCounter::CharsPerToken => tally.fallback_tokens(),
                TokenCounter::Tokenizer(t) => match t.encode(&**p, false) {
                    Ok(enc) => enc.len() as u64,
                    // A text the tokenizer cannot encode still costs something.
                    Err(_) => tally.fallback_tokens(),
                },
            };
        }
        let framing = if prompt.chat {
            TOKENS_PER_CHAT + TOKENS_PER_MESSAGE * prompt.parts.len() as u64
        } else {
            0
        };
        let tokens = framing + text_tokens + prompt.token_ids + prompt.images * TOKENS_PER_IMAGE;
        (tokens, all.kind())
    }

    /// Prompt tokens of `prompt` (tests: the request path measures).
    #[cfg(test)]
    pub fn count(&self, prompt: &PromptText) -> u64 {
        self.measure(prompt).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenizer_json_counts_exactly() {
        use tokenizers::models::wordlevel::WordLevel;
        use tokenizers::pre_tokenizers::whitespace::Whitespace;
        let vocab = [("[UNK]", 0u32), ("hello", 1), ("world", 2)]
            .into_iter()
            .map(|(w, i)| (w.to_string(), i))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = tokenizers::Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Whitespace {}));
        let dir = std::env::temp_dir().join(format!("levee-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        t.save(&path, false).unwrap();
        let counter = TokenCounter::from_file(&path).unwrap();
        let p = PromptText {
            // 5 words: 5 tokens (the fallback rule would say ⌈29 / 4⌉ = 8).
            parts: vec!["hello world hello world xyzzy".into()],
            chat: false,
            token_ids: 0,
            ..PromptText::default()
        };
        assert_eq!(counter.count(&p), 5);
        assert_eq!(TokenCounter::CharsPerToken.count(&p), 8);
        let err = TokenCounter::from_file(&dir.join("missing.json")).unwrap_err();
        assert!(err.contains("missing.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fallback_matches_the_chat_rule() {
        let p = PromptText {
            parts: vec!["hello world!".into(), "".into()],
            chat: true,
            token_ids: 0,
            ..PromptText::default()
        };
        // 2 + (4 + 3) + (4 + 0)
        assert_eq!(TokenCounter::CharsPerToken.count(&p), 13);
        let c = PromptText {
            parts: vec!["abcde".into()],
            chat: false,
            token_ids: 3,
            ..PromptText::default()
        };
        assert_eq!(TokenCounter::CharsPerToken.count(&c), 5);
    }

    #[test]
    fn cjk_counts_a_token_a_character_and_kinds_follow_the_text() {
        use levee_policy::TextKind;
        let p = |t: &str| PromptText {
            parts: vec![t.to_owned().into()],
            ..PromptText::default()
        };
        // 6 Han characters and "ok" (2 others): 6 + 1.
        assert_eq!(TokenCounter::CharsPerToken.count(&p("流量控制网关ok")), 7);
        let kind = |t: &str| TokenCounter::CharsPerToken.measure(&p(t)).1;
        assert_eq!(kind("流量控制网关ok"), TextKind::Dense);
        assert_eq!(kind("The river rose all night."), TextKind::Prose);
        assert_eq!(kind("fn f(x: u8) -> u8 { x + 1 }"), TextKind::Symbols);
        assert_eq!(kind(""), TextKind::Prose);
    }

    proptest::proptest! {
        /// The ASCII shortcut counts every character as the general rule does.
        #[test]
        fn the_ascii_shortcut_counts_as_the_general_rule(
            text in "[\\x00-\\x7f\u{a0}\u{85}\u{3000}\u{6d41}\u{ac00}é]{0,40}"
        ) {
            let mut general = Tally::default();
            text.chars().for_each(|c| general.count(c));
            proptest::prop_assert_eq!(Tally::of(&text), general);
        }
    }
}
