//! The engine's own tokenizer: a made-up, deterministic, content-dependent token rule that
//! levee (the gateway) does not reproduce, so that its estimate of a prompt can be wrong the
//! way an estimate of a real engine's count is wrong.
//!
//! It is not a BPE: a hand-written scanner cuts the text into pieces by character class,
//! loosely after the pre-tokenizers of GPT-style BPE tokenizers, and each piece is one token:
//!
//! | text | tokens |
//! | --- | --- |
//! | a word (a run of letters) | one per [`WORD_CHUNK`] letters, rounded up; a letter outside ASCII weighs two |
//! | a run of ASCII digits | one per group of up to [`DIGITS_PER_TOKEN`] digits |
//! | a run of punctuation (ASCII symbols, U+2000–U+206F) | one per [`PUNCT_PER_TOKEN`] characters, rounded up |
//! | a run of whitespace | one per [`SPACES_PER_TOKEN`] characters, rounded up |
//! | a CJK character (Han, Kana, Hangul, CJK and full-width punctuation) | one each |
//! | any other character (emoji, symbols) | one per UTF-8 byte (byte fallback) |
//!
//! A single space directly before a word or a punctuation run belongs to that token
//! (`" river"` is one token, as in GPT tokenizers), and so does one punctuation character
//! directly before a word (`"_name"`, `".field"`, `"'t"`).
//!
//! Each token has an id (a hash of its text, or a fixed id for the chat template's special
//! tokens), so `/tokenize` can list them and equal text gives equal ids.
//!
//! Chat requests are rendered through a made-up chat template before counting
//! ([`render_chat`]): [`CHAT_TOKENS_PER_PROMPT`] tokens per prompt (a begin-of-sequence token
//! and the assistant's reply header), [`CHAT_TOKENS_PER_MESSAGE`] per message (start, role,
//! newline, end, newline), the text of every text part (parts of one message joined by a
//! newline), [`IMAGE_TOKENS`] per image part, each assistant tool call's name and arguments
//! plus [`TOOL_CALL_OVERHEAD`], and the request's `tools` definitions as compact JSON plus
//! [`TOOLS_OVERHEAD`].
//!
//! [`TokenizerKind::LeveeRule`] instead counts exactly as levee's fallback rule does
//! (`crate::tokens`): `ceil(chars / 4)` of each message's text, 4 per message and 2 per chat,
//! nothing for tools or images. It exists for tests that need the engine and levee to agree.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Letters per token of a long word (a shorter word is one token).
pub const WORD_CHUNK: u32 = 6;
/// Digits per token (numbers are cut in groups of up to three).
pub const DIGITS_PER_TOKEN: usize = 3;
/// Characters per token of a punctuation run.
pub const PUNCT_PER_TOKEN: usize = 2;
/// Characters per token of a whitespace run.
pub const SPACES_PER_TOKEN: usize = 8;
/// Template tokens per chat message: start, role, newline, end, newline.
pub const CHAT_TOKENS_PER_MESSAGE: u32 = 5;
/// Template tokens per chat prompt: begin-of-sequence and the reply header (start,
/// `assistant`, newline).
pub const CHAT_TOKENS_PER_PROMPT: u32 = 4;
/// Tokens of one image part, whatever its size (Gemma 3 encodes every image as 256 soft
/// tokens; other vision models use a similar fixed budget per image or tile).
pub const IMAGE_TOKENS: u32 = 256;
/// Template tokens around the `tools` definitions (start and end of the tools block).
pub const TOOLS_OVERHEAD: u32 = 2;
/// Template tokens around one assistant tool call (start and end).
pub const TOOL_CALL_OVERHEAD: u32 = 2;

/// Which rule the engine counts prompt tokens by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TokenizerKind {
    /// The engine's own tokenizer (this module), which levee does not reproduce.
    #[default]
    Engine,
    /// levee's fallback rule exactly (`ceil(chars / 4)` per message text, 4 per message, 2
    /// per chat; tools and images free): for tests that need levee and the engine to agree.
    LeveeRule,
}

/// A token id.
pub type TokenId = u32;

/// Special tokens of the chat template (ids below [`FIRST_TEXT_ID`]).
mod special {
    use super::TokenId;
    pub const BOS: TokenId = 1;
    pub const START: TokenId = 2;
    pub const END: TokenId = 3;
    pub const NEWLINE: TokenId = 4;
    pub const ROLE_SYSTEM: TokenId = 5;
    pub const ROLE_USER: TokenId = 6;
    pub const ROLE_ASSISTANT: TokenId = 7;
    pub const ROLE_TOOL: TokenId = 8;
    pub const ROLE_OTHER: TokenId = 9;
    pub const TOOLS_START: TokenId = 10;
    pub const TOOLS_END: TokenId = 11;
    pub const CALL_START: TokenId = 12;
    pub const CALL_END: TokenId = 13;
}

/// Ids of text pieces start here; ids of image tokens too (they hash the image's URL).
const FIRST_TEXT_ID: TokenId = 256;
/// Size of the made-up vocabulary of text pieces.
const VOCAB: u64 = 150_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Space,
    Letter,
    Digit,
    Punct,
    Cjk,
    Other,
}

fn is_cjk(c: char) -> bool {
    matches!(u32::from(c),
        0x1100..=0x11FF      // Hangul Jamo
        | 0x2E80..=0x2FDF    // CJK radicals
        | 0x3000..=0x303F    // CJK symbols and punctuation
        | 0x3040..=0x30FF    // Hiragana, Katakana
        | 0x3100..=0x31FF    // Bopomofo, Hangul compatibility Jamo, Kanbun, Katakana ext.
        | 0x3400..=0x4DBF    // CJK extension A
        | 0x4E00..=0x9FFF    // CJK unified ideographs
        | 0xAC00..=0xD7AF    // Hangul syllables
        | 0xF900..=0xFAFF    // CJK compatibility ideographs
        | 0xFF00..=0xFFEF    // half-width and full-width forms
        | 0x20000..=0x3134F  // CJK extensions B–G
    )
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_ascii_digit() {
        Class::Digit
    } else if c.is_ascii_punctuation() || ('\u{2000}'..='\u{206F}').contains(&c) {
        Class::Punct
    } else if is_cjk(c) {
        Class::Cjk
    } else if c.is_alphabetic() {
        Class::Letter
    } else {
        Class::Other
    }
}

/// Weight of a letter in a word: ASCII letters 1, others 2 (a BPE vocabulary holds fewer
/// merges for them).
fn letter_weight(c: char) -> u32 {
    if c.is_ascii() {
        1
    } else {
        2
    }
}

/// Cuts `text` into token pieces and calls `emit` with the bytes of each, in order.
fn scan(text: &str, mut emit: impl FnMut(&[u8])) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |k: usize| chars.get(k).map_or(text.len(), |&(b, _)| b);
    let class_at = |k: usize| chars.get(k).map(|&(_, c)| class(c));
    let run_end = |from: usize, cls: Class| {
        let mut j = from;
        while class_at(j) == Some(cls) {
            j += 1;
        }
        j
    };
    let bytes = text.as_bytes();
    let piece = |from: usize, to: usize| bytes.get(at(from)..at(to)).unwrap_or_default();
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let next = class_at(i + 1);
        // One character attached before a word or a punctuation run.
        let attaches = (c == ' ' && matches!(next, Some(Class::Letter | Class::Punct)))
            || (class(c) == Class::Punct && next == Some(Class::Letter));
        let (start, body) = if attaches { (i, i + 1) } else { (i, i) };
        let cls = if attaches {
            next.unwrap_or(Class::Other)
        } else {
            class(c)
        };
        match cls {
            Class::Letter => {
                let end = run_end(body, Class::Letter);
                let mut from = start;
                let mut weight = 0;
                for (k, &(_, ch)) in chars.iter().enumerate().take(end).skip(body) {
                    let w = letter_weight(ch);
                    if weight > 0 && weight + w > WORD_CHUNK {
                        emit(piece(from, k));
                        from = k;
                        weight = 0;
                    }
                    weight += w;
                }
                emit(piece(from, end));
                i = end;
            }
            Class::Punct => {
                let mut end = run_end(body, Class::Punct);
                // The run's last character goes with a word right after it.
                if !attaches && end - body >= 2 && class_at(end) == Some(Class::Letter) {
                    end -= 1;
                }
                let mut from = start;
                while from < end {
                    let to = if from == start {
                        (body + PUNCT_PER_TOKEN).min(end)
                    } else {
                        (from + PUNCT_PER_TOKEN).min(end)
                    };
                    emit(piece(from, to));
                    from = to;
                }
                i = end;
            }
            Class::Space => {
                let mut end = run_end(body, Class::Space);
                // The run's last space goes with the word or punctuation right after it.
                if end - body >= 2
                    && chars[end - 1].1 == ' '
                    && matches!(class_at(end), Some(Class::Letter | Class::Punct))
                {
                    end -= 1;
                }
                let mut from = start;
                while from < end {
                    let to = (from + SPACES_PER_TOKEN).min(end);
                    emit(piece(from, to));
                    from = to;
                }
                i = end;
            }
            Class::Digit => {
                let end = run_end(body, Class::Digit);
                let mut from = start;
                while from < end {
                    let to = (from + DIGITS_PER_TOKEN).min(end);
                    emit(piece(from, to));
                    from = to;
                }
                i = end;
            }
            Class::Cjk => {
                emit(piece(i, i + 1));
                i += 1;
            }
            Class::Other => {
                for b in piece(i, i + 1).chunks(1) {
                    emit(b);
                }
                i += 1;
            }
        }
    }
}

/// FNV-1a, 64 bits.
fn fnv(bytes: &[u8], seed: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The id of a text piece.
pub fn piece_id(piece: &[u8]) -> TokenId {
    // VOCAB fits in u32, so the conversion never fails.
    FIRST_TEXT_ID + TokenId::try_from(fnv(piece, 0) % VOCAB).unwrap_or(0)
}

/// Tokens of a plain text by the engine's tokenizer (no template).
pub fn count_text(text: &str) -> u32 {
    let mut n: u32 = 0;
    scan(text, |_| n = n.saturating_add(1));
    n
}

/// Appends the ids of a plain text's tokens by the engine's tokenizer.
pub fn encode_text(text: &str, out: &mut Vec<TokenId>) {
    scan(text, |p| out.push(piece_id(p)));
}

/// One part of a chat message's content.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Text.
    Text(String),
    /// An image, named by its URL (or data URL): [`IMAGE_TOKENS`] tokens.
    Image(String),
}

/// A chat message as the template sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The content: a string is one text part.
    pub parts: Vec<Part>,
    /// An assistant's tool calls: `(function name, arguments JSON text)`.
    pub tool_calls: Vec<(String, String)>,
}

impl Message {
    /// Reads one OpenAI chat message (`role`, `content` as a string or an array of parts,
    /// `tool_calls`). Text parts are `{"type": "text", "text"}`; image parts are
    /// `{"type": "image_url", "image_url": {"url"}}` (or `"image_url": "..."`, or type
    /// `input_image` / `image`); parts of any other type are not counted.
    pub fn from_json(v: &Value) -> Self {
        let role = v
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user")
            .to_string();
        let parts = match v.get("content") {
            Some(Value::String(s)) => vec![Part::Text(s.clone())],
            Some(Value::Array(items)) => items.iter().filter_map(part_from_json).collect(),
            _ => Vec::new(),
        };
        let tool_calls = v
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let f = c.get("function").unwrap_or(&Value::Null);
                        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                        let args = match f.get("arguments") {
                            Some(Value::String(s)) => s.clone(),
                            Some(Value::Null) | None => String::new(),
                            Some(other) => other.to_string(),
                        };
                        (name.to_string(), args)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self {
            role,
            parts,
            tool_calls,
        }
    }

    /// The text of the message: its text parts joined by newlines.
    pub fn text(&self) -> String {
        let texts: Vec<&str> = self
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t.as_str()),
                Part::Image(_) => None,
            })
            .collect();
        texts.join("\n")
    }
}

fn part_from_json(p: &Value) -> Option<Part> {
    let kind = p.get("type").and_then(Value::as_str).unwrap_or("text");
    match kind {
        "text" | "input_text" => p
            .get("text")
            .and_then(Value::as_str)
            .map(|t| Part::Text(t.to_string())),
        "image_url" | "input_image" | "image" => {
            let url = match p.get("image_url").or_else(|| p.get("image")) {
                Some(Value::String(s)) => s.clone(),
                Some(obj) => obj
                    .get("url")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                None => String::new(),
            };
            Some(Part::Image(url))
        }
        _ => None,
    }
}

fn role_id(role: &str) -> TokenId {
    match role {
        "system" | "developer" => special::ROLE_SYSTEM,
        "user" => special::ROLE_USER,
        "assistant" => special::ROLE_ASSISTANT,
        "tool" | "function" => special::ROLE_TOOL,
        _ => special::ROLE_OTHER,
    }
}

/// Pushes ids of `text` cut into pieces of 4 characters (levee's rule: `ceil(chars / 4)`).
fn encode_levee_rule(text: &str, out: &mut Vec<TokenId>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    for chunk in chars.chunks(4) {
        let from = chunk.first().map_or(0, |&(b, _)| b);
        let to = chunk.last().map_or(0, |&(b, c)| b + c.len_utf8());
        out.push(piece_id(text.as_bytes().get(from..to).unwrap_or_default()));
    }
}

impl TokenizerKind {
    /// The token ids of a chat prompt: `tools` (the request's `tools` array, if any) and the
    /// messages rendered through the template, ending with the reply header when
    /// `generation_prompt` is true (as for every chat request; `/tokenize` may leave it out).
    pub fn render_chat(
        self,
        messages: &[Message],
        tools: Option<&Value>,
        generation_prompt: bool,
    ) -> Vec<TokenId> {
        let mut out = Vec::new();
        match self {
            TokenizerKind::Engine => {
                out.push(special::BOS);
                if let Some(tools) = tools.filter(|t| !t.is_null()) {
                    out.push(special::TOOLS_START);
                    encode_text(&tools.to_string(), &mut out);
                    out.push(special::TOOLS_END);
                }
                for m in messages {
                    out.extend([special::START, role_id(&m.role), special::NEWLINE]);
                    let mut first = true;
                    for p in &m.parts {
                        match p {
                            Part::Text(t) => {
                                if !first {
                                    out.push(special::NEWLINE);
                                }
                                first = false;
                                encode_text(t, &mut out);
                            }
                            Part::Image(url) => {
                                let h = fnv(url.as_bytes(), 0x1a6e);
                                out.extend((0..u64::from(IMAGE_TOKENS)).map(|k| {
                                    FIRST_TEXT_ID
                                        + TokenId::try_from(crate::tokens::mix(h ^ k) % VOCAB)
                                            .unwrap_or(0)
                                }));
                            }
                        }
                    }
                    for (name, args) in &m.tool_calls {
                        out.push(special::CALL_START);
                        encode_text(name, &mut out);
                        encode_text(args, &mut out);
                        out.push(special::CALL_END);
                    }
                    out.extend([special::END, special::NEWLINE]);
                }
                if generation_prompt {
                    out.extend([special::START, special::ROLE_ASSISTANT, special::NEWLINE]);
                }
            }
            TokenizerKind::LeveeRule => {
                for m in messages {
                    out.extend([
                        special::START,
                        role_id(&m.role),
                        special::NEWLINE,
                        special::END,
                    ]);
                    encode_levee_rule(&m.text(), &mut out);
                }
                if generation_prompt {
                    out.extend([special::START, special::ROLE_ASSISTANT]);
                }
            }
        }
        out
    }

    /// The token ids of a plain (completions API) prompt: the engine's tokenizer adds a
    /// begin-of-sequence token; levee's rule counts the text alone.
    pub fn encode_prompt(self, text: &str) -> Vec<TokenId> {
        let mut out = Vec::new();
        match self {
            TokenizerKind::Engine => {
                out.push(special::BOS);
                encode_text(text, &mut out);
            }
            TokenizerKind::LeveeRule => encode_levee_rule(text, &mut out),
        }
        out
    }

    /// The id of a generated token whose text is `text` (one piece).
    pub fn generated_id(self, text: &str) -> TokenId {
        piece_id(text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn pieces(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        scan(text, |p| out.push(String::from_utf8_lossy(p).into_owned()));
        out
    }

    #[test]
    fn pieces_follow_the_character_classes() {
        assert_eq!(pieces("The river rose."), ["The", " river", " rose", "."]);
        assert_eq!(pieces("levees"), ["levees"]);
        // A long word splits every six letters; the leading space goes with the first piece.
        assert_eq!(pieces(" embankments"), [" embank", "ments"]);
        assert_eq!(pieces("1234567"), ["123", "456", "7"]);
        assert_eq!(pieces("水位上升"), ["水", "位", "上", "升"]);
        assert_eq!(pieces("すいい"), ["す", "い", "い"]);
        assert_eq!(pieces("홍수"), ["홍", "수"]);
        assert_eq!(pieces("don't"), ["don", "'t"]);
        assert_eq!(pieces("fn x_y() {"), ["fn", " x", "_y", "()", " {"]);
        assert_eq!(pieces("a\n        b"), ["a", "\n       ", " b"]);
        assert_eq!(pieces("{\"k\": 12}"), ["{", "\"k", "\":", " ", "12", "}"]);
        // Byte fallback: a 4-byte emoji is 4 tokens.
        assert_eq!(count_text("🌊"), 4);
        assert_eq!(count_text(""), 0);
    }

    #[test]
    fn ids_are_stable_and_content_dependent() {
        let mut a = Vec::new();
        encode_text("the river", &mut a);
        let mut b = Vec::new();
        encode_text("the river", &mut b);
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], a[1]);
        assert!(a.iter().all(|&id| id >= FIRST_TEXT_ID));
        assert_eq!(
            TokenizerKind::Engine.generated_id(" river"),
            piece_id(b" river")
        );
    }

    #[test]
    fn chat_template_counts_messages_tools_calls_and_images() {
        let user = Message::from_json(&json!({"role": "user", "content": "Hello there"}));
        let ids = TokenizerKind::Engine.render_chat(std::slice::from_ref(&user), None, true);
        // 4 per prompt + 5 per message + "Hello", " there".
        assert_eq!(ids.len(), 4 + 5 + 2);
        // Parts: two text parts joined by a newline token, an image of 256 tokens.
        let parts = Message::from_json(&json!({"role": "user", "content": [
            {"type": "text", "text": "Hello"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
            {"type": "text", "text": "there"},
        ]}));
        let ids = TokenizerKind::Engine.render_chat(std::slice::from_ref(&parts), None, true);
        assert_eq!(ids.len(), 4 + 5 + 1 + 1 + 1 + IMAGE_TOKENS as usize);
        // Tool calls: name and arguments plus 2 each.
        let call = Message::from_json(&json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_level", "arguments": "{\"gauge\":\"A1\"}"}}]}));
        let ids = TokenizerKind::Engine.render_chat(std::slice::from_ref(&call), None, true);
        let args = count_text("get_level") + count_text("{\"gauge\":\"A1\"}");
        assert_eq!(ids.len() as u32, 4 + 5 + TOOL_CALL_OVERHEAD + args);
        // Tools: their compact JSON plus 2.
        let tools = json!([{"type": "function", "function": {"name": "get_level",
            "parameters": {"type": "object", "properties": {"gauge": {"type": "string"}}}}}]);
        let with =
            TokenizerKind::Engine.render_chat(std::slice::from_ref(&user), Some(&tools), true);
        assert_eq!(
            with.len() as u32,
            4 + 5 + 2 + TOOLS_OVERHEAD + count_text(&tools.to_string())
        );
        // The same image gives the same ids, another image others.
        let other = Message::from_json(&json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.invalid/b.png"}}]}));
        let again = TokenizerKind::Engine.render_chat(std::slice::from_ref(&parts), None, true);
        assert_eq!(
            again,
            TokenizerKind::Engine.render_chat(&[parts], None, true)
        );
        assert_ne!(
            TokenizerKind::Engine.render_chat(&[other], None, true)[..20],
            again[..20]
        );
    }

    #[test]
    fn levee_rule_is_exactly_the_fallback_rule() {
        let msgs = [
            Message::from_json(&json!({"role": "system", "content": "水水水水水"})),
            Message::from_json(&json!({"role": "user", "content": [
                {"type": "text", "text": "abcd"}, {"type": "text", "text": "ef"},
                {"type": "image_url", "image_url": {"url": "x"}}]})),
        ];
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let ids = TokenizerKind::LeveeRule.render_chat(&msgs, Some(&tools), true);
        let expect = crate::tokens::estimate_chat_prompt_tokens(["水水水水水", "abcd\nef"]);
        assert_eq!(ids.len() as u32, expect);
        assert_eq!(
            TokenizerKind::LeveeRule.encode_prompt("abcde").len() as u32,
            crate::tokens::estimate_prompt_tokens("abcde")
        );
    }

    /// English prose, written for this test.
    const ENGLISH: &str = "When the river rises in spring, the town watches the levee. \
        Engineers walk its crest every morning, measuring the water against painted marks \
        and listening for the quiet hiss that means seepage. A levee rarely fails all at \
        once: it weakens where the soil was poorly compacted, where burrowing animals left \
        tunnels, or where an old culvert was forgotten. The crews carry sandbags, plastic \
        sheeting and pumps, and they write down everything they see, because the next \
        flood will ask the same questions. Nobody remembers the dry years, but everybody \
        remembers the night the water came over the road near the grain elevator.";
    /// Chinese prose, written for this test.
    const CJK: &str = "春天河水上涨的时候，全镇的人都看着堤坝。工程师每天早上沿着堤顶巡查，\
        把水位和刷在墙上的刻度对比，还仔细听有没有渗水的声音。堤坝很少一下子全部垮掉，\
        它往往在土没有压实的地方、动物打洞的地方，或者被遗忘的旧涵洞那里慢慢变弱。";
    /// Rust code, written for this test.
    const CODE: &str = "fn crest_height(levee: &Levee, gauge_mm: u32) -> Result<u32, Error> {\n\
        \x20   let margin = levee.freeboard_mm.saturating_sub(gauge_mm);\n\
        \x20   if margin < 300 {\n\
        \x20       return Err(Error::Overtopping { margin });\n\
        \x20   }\n\
        \x20   Ok(levee.crest_mm + margin / 2)\n\
        }\n";
    /// JSON, written for this test.
    const JSON: &str = r#"{"gauge":"A-17","readings":[{"t":"2024-04-02T06:00:00Z","level_mm":4125},{"t":"2024-04-02T07:00:00Z","level_mm":4190}],"alert":false}"#;

    fn chars_per_token(text: &str) -> f64 {
        text.chars().count() as f64 / f64::from(count_text(text))
    }

    #[test]
    fn ratios_to_the_chars_over_four_rule_depend_on_the_text() {
        let english = chars_per_token(ENGLISH);
        assert!(
            (4.0..=5.0).contains(&english),
            "english {english:.2} chars/token"
        );
        let cjk = chars_per_token(CJK);
        assert!((0.95..=1.05).contains(&cjk), "cjk {cjk:.2} chars/token");
        let code = chars_per_token(CODE);
        assert!((2.0..=4.0).contains(&code), "code {code:.2} chars/token");
        let json = chars_per_token(JSON);
        assert!((2.0..=4.0).contains(&json), "json {json:.2} chars/token");
        // Printed with --nocapture; docs/engine.md quotes these figures.
        for (name, text) in [
            ("english", ENGLISH),
            ("cjk", CJK),
            ("code", CODE),
            ("json", JSON),
        ] {
            println!(
                "{name}: {} chars, {} tokens, {:.2} chars/token, engine / ceil(chars/4) = {:.2}",
                text.chars().count(),
                count_text(text),
                chars_per_token(text),
                f64::from(count_text(text))
                    / f64::from(crate::tokens::estimate_prompt_tokens(text))
            );
        }
    }

    /// Characters of every class, so random strings exercise every boundary.
    fn text() -> impl Strategy<Value = String> {
        let alphabet: Vec<char> = "aZq é ñ Ж  \n\t09 5 .,;:_-(){}\"' 水中文 かな 한 🌊 → — x y"
            .chars()
            .collect();
        proptest::collection::vec(proptest::sample::select(alphabet), 0..60)
            .prop_map(|cs| cs.into_iter().collect())
    }

    proptest! {
        #[test]
        fn counting_is_deterministic_and_appending_never_lowers_it(a in text(), b in text()) {
            let n = count_text(&a);
            prop_assert_eq!(n, count_text(&a));
            let joined = format!("{a}{b}");
            prop_assert!(count_text(&joined) >= n, "{joined:?}");
            prop_assert!(count_text(&joined) >= count_text(&b));
            // Every character is in some token, and no token is empty.
            let mut total = 0;
            scan(&joined, |p| { assert!(!p.is_empty()); total += p.len(); });
            prop_assert_eq!(total, joined.len());
            // The ids match the count.
            let mut ids = Vec::new();
            encode_text(&joined, &mut ids);
            prop_assert_eq!(ids.len() as u32, count_text(&joined));
        }

        #[test]
        fn cjk_text_counts_one_token_per_character(
            s in proptest::collection::vec(proptest::char::range('\u{4E00}', '\u{9FFF}'), 1..200)
        ) {
            let text: String = s.iter().collect();
            prop_assert_eq!(count_text(&text) as usize, s.len());
        }
    }
}
