//! The `x-levee-degraded` marker: levee answered, but less than asked, because the model's
//! lane is overloaded. Its value lists the measures taken, comma-separated:
//! `max_tokens=N` (the completion was capped at N tokens), `fallback=MODEL` (a smaller model
//! answered), `fallback_response` (a canned reply, no backend could serve), `cache` (a
//! stored answer to the same request). Such an answer is final: asking again while the lane
//! is overloaded adds load and gets the same kind of answer, so [`crate::Client`] never
//! retries it.

/// The measures one answer was degraded by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Degradation {
    measures: Vec<String>,
}

impl Degradation {
    /// Parses the header's value; `None` when it names no measure.
    pub fn parse(value: &str) -> Option<Self> {
        let measures: Vec<String> = value
            .split(',')
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(str::to_string)
            .collect();
        (!measures.is_empty()).then_some(Degradation { measures })
    }

    /// Reads `x-levee-degraded` from a header map.
    pub fn from_headers(headers: &reqwest::header::HeaderMap) -> Option<Self> {
        Self::parse(headers.get("x-levee-degraded")?.to_str().ok()?)
    }

    /// The measures, as sent.
    pub fn measures(&self) -> &[String] {
        &self.measures
    }

    fn value(&self, key: &str) -> Option<&str> {
        self.measures
            .iter()
            .find_map(|m| m.strip_prefix(key)?.strip_prefix('='))
    }

    /// The `max_tokens` the completion was capped at, if it was: a completion that ends
    /// with `finish_reason: "length"` at this many tokens was cut by the cap, not by the model.
    pub fn max_tokens_cap(&self) -> Option<u32> {
        self.value("max_tokens")?.parse().ok()
    }

    /// The model that answered instead of the one asked for, if any.
    pub fn fallback_model(&self) -> Option<&str> {
        self.value("fallback")
    }

    /// Whether the answer is a canned reply (no backend could serve).
    pub fn canned(&self) -> bool {
        self.measures.iter().any(|m| m == "fallback_response")
    }

    /// Whether the answer came from levee's response cache.
    pub fn cached(&self) -> bool {
        self.measures.iter().any(|m| m == "cache")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_are_read() {
        let d = Degradation::parse("max_tokens=256, fallback=small").unwrap();
        assert_eq!(d.max_tokens_cap(), Some(256));
        assert_eq!(d.fallback_model(), Some("small"));
        assert!(!d.canned());
        let c = Degradation::parse("fallback_response").unwrap();
        assert!(c.canned());
        assert_eq!(c.fallback_model(), None);
        assert!(Degradation::parse("cache").unwrap().cached());
        assert_eq!(Degradation::parse(" , "), None);
    }
}
