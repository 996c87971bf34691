//! A JSON value read from a request body the way the gateway looks inside one: strings
//! borrowed from the body where they hold no escapes, objects as their fields in order.
//! Reading one builds no map and copies no plain string, where `serde_json::Value` does both.
//! And where a top-level field's value starts, found without reading the others.

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// A JSON value as the gateway looks inside one (messages, their parts, scalar fields):
/// strings borrowed from the body where they hold no escapes, objects as their fields in
/// the order sent (a repeated key is kept; [`Lite::get`] reads the last, as a map would).
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) enum Lite<'a> {
    #[default]
    Null,
    Bool(bool),
    Num(serde_json::Number),
    Str(Cow<'a, str>),
    Arr(Vec<Lite<'a>>),
    Obj(Vec<(Cow<'a, str>, Lite<'a>)>),
}

impl<'a> Lite<'a> {
    /// The value of field `key` of an object (the last, when repeated).
    pub(crate) fn get(&self, key: &str) -> Option<&Lite<'a>> {
        match self {
            Lite::Obj(fields) => fields.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Field `key` of an object taken out (the last, when repeated).
    pub(crate) fn take(&mut self, key: &str) -> Option<Lite<'a>> {
        match self {
            Lite::Obj(fields) => fields
                .iter_mut()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| std::mem::take(v)),
            _ => None,
        }
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Lite::Str(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn as_array(&self) -> Option<&[Lite<'a>]> {
        match self {
            Lite::Arr(items) => Some(items),
            _ => None,
        }
    }

    pub(crate) fn as_bool(&self) -> Option<bool> {
        match self {
            Lite::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            Lite::Num(n) => n.as_u64(),
            _ => None,
        }
    }
}

/// A string (or an object key) borrowed from the body when it holds no escape.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Lite<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lite<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Lite<'de>, E> {
                Ok(Lite::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Lite<'de>, E> {
                Ok(Lite::Null)
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Lite<'de>, E> {
                Ok(Lite::Bool(b))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Lite<'de>, E> {
                Ok(Lite::Num(n.into()))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Lite<'de>, E> {
                Ok(Lite::Num(n.into()))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Lite<'de>, E> {
                // JSON has no NaN or infinity: every number it reads is finite.
                Ok(serde_json::Number::from_f64(n).map_or(Lite::Null, Lite::Num))
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Lite<'de>, E> {
                Ok(Lite::Str(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Lite<'de>, E> {
                Ok(Lite::Str(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Lite<'de>, E> {
                Ok(Lite::Str(Cow::Owned(s)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Lite<'de>, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(v) = seq.next_element()? {
                    items.push(v);
                }
                Ok(Lite::Arr(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Lite<'de>, A::Error> {
                let mut fields = Vec::new();
                while let Some(Text(k)) = m.next_key()? {
                    fields.push((k, m.next_value()?));
                }
                Ok(Lite::Obj(fields))
            }
        }
        d.deserialize_any(V)
    }
}

/// As JSON: keys in the order read, a repeated key repeated (it keys a conversation).
impl Serialize for Lite<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            Lite::Null => s.serialize_unit(),
            Lite::Bool(b) => s.serialize_bool(*b),
            Lite::Num(n) => n.serialize(s),
            Lite::Str(t) => s.serialize_str(t),
            Lite::Arr(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for i in items {
                    seq.serialize_element(i)?;
                }
                seq.end()
            }
            Lite::Obj(fields) => {
                let mut map = s.serialize_map(Some(fields.len()))?;
                for (k, v) in fields {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

/// Where the value of top-level field `key` starts in the JSON object `json` (the slice runs
/// to the end of `json`: read one value from its start), found without reading the other
/// fields' values: strings are skipped from escape to escape, nesting only counted. `None`
/// when the object has no such field, or the key is written with escapes.
pub(crate) fn top_level_value<'a>(json: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let skip_space = |mut j: usize| {
        while matches!(json.get(j), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            j += 1;
        }
        j
    };
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(&c) = json.get(i) {
        match c {
            b'"' => {
                let end = string_end(json, i + 1)?;
                let name = &json[i + 1..end];
                i = end + 1;
                if depth == 1 {
                    let colon = skip_space(i);
                    if json.get(colon) == Some(&b':') {
                        if name == key.as_bytes() {
                            return Some(&json[skip_space(colon + 1)..]);
                        }
                        i = colon + 1;
                    }
                }
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// The index of the quote that closes the string whose text starts at `i`.
fn string_end(json: &[u8], mut i: usize) -> Option<usize> {
    loop {
        i += memchr::memchr2(b'"', b'\\', json.get(i..)?)?;
        if json[i] == b'"' {
            return Some(i);
        }
        i += 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An object key: short, with a quote to escape now and then, or `usage`.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![4 => "[a-z\"]{1,3}", 1 => Just("usage".to_string())]
    }

    /// Any JSON value, nested up to three levels, with strings that need escapes.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1e12f64..1e12).prop_map(Value::from),
            "[a-z\"\\\\\n\u{e9}\u{6d41}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(key(), inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The value found for a top-level key is the one serde_json reads for it, wherever
        /// the key is and whatever nests around it (`usage` inside other values too).
        #[test]
        fn a_top_level_value_is_found_where_serde_json_reads_it(
            fields in prop::collection::btree_map(key(), json(), 0..6),
            pretty in any::<bool>(),
        ) {
            let object = serde_json::Value::Object(fields.into_iter().collect());
            let text = if pretty {
                serde_json::to_string_pretty(&object).unwrap()
            } else {
                object.to_string()
            };
            let found = top_level_value(text.as_bytes(), "usage").map(|v| {
                let mut de = serde_json::Deserializer::from_slice(v);
                serde_json::Value::deserialize(&mut de).unwrap()
            });
            let read: serde_json::Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(found.as_ref(), read.get("usage"));
        }

        /// What the gateway reads of a JSON text is that text's value: written out again it
        /// is the value serde_json reads (numbers, escapes and nesting included).
        #[test]
        fn lite_reads_what_serde_json_reads(v in json()) {
            let text = v.to_string();
            let lite: Lite = serde_json::from_str(&text).unwrap();
            let read: serde_json::Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(serde_json::to_value(&lite).unwrap(), read);
        }
    }
}
