//! Parsing of the headers by which a server says when to come back.
//!
//! `retry-after-ms` (milliseconds, as sent by levee and by OpenAI) is preferred because it
//! is more precise; `Retry-After` is either a number of seconds or an HTTP date
//! (RFC 9110 §10.2.3).

use std::time::{Duration, SystemTime};

/// The wait a server asked for, from the raw header values.
///
/// `now` is the client's wall clock, used only for the HTTP-date form; a date in the past
/// means "retry now" (zero). Returns `None` when neither header is present or parseable:
/// a malformed header is ignored rather than trusted.
pub fn parse(
    retry_after: Option<&str>,
    retry_after_ms: Option<&str>,
    now: SystemTime,
) -> Option<Duration> {
    if let Some(ms) = retry_after_ms.and_then(parse_millis) {
        return Some(ms);
    }
    let value = retry_after?.trim();
    if let Some(secs) = parse_seconds(value) {
        return Some(secs);
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Reads both headers from a header map (any `http` 1.x map, e.g. reqwest's or hyper's).
pub fn from_headers(headers: &reqwest::header::HeaderMap, now: SystemTime) -> Option<Duration> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    parse(get("retry-after"), get("retry-after-ms"), now)
}

fn parse_millis(value: &str) -> Option<Duration> {
    let ms: f64 = value.trim().parse().ok()?;
    (0.0..1e12)
        .contains(&ms)
        .then(|| Duration::from_secs_f64(ms / 1000.0))
}

fn parse_seconds(value: &str) -> Option<Duration> {
    // RFC 9110 allows only a non-negative integer; we also accept a decimal because some
    // servers send one, and refuse anything negative or absurd.
    let secs: f64 = value.parse().ok()?;
    (0.0..1e9)
        .contains(&secs)
        .then(|| Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_win_over_seconds() {
        let now = SystemTime::UNIX_EPOCH;
        assert_eq!(
            parse(Some("3"), Some("1500"), now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse(Some("3"), None, now), Some(Duration::from_secs(3)));
        assert_eq!(
            parse(Some("3"), Some("junk"), now),
            Some(Duration::from_secs(3))
        );
    }

    #[test]
    fn http_date_is_relative_to_now() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:30 GMT").unwrap();
        assert_eq!(
            parse(Some("Sun, 06 Nov 1994 08:49:37 GMT"), None, now),
            Some(Duration::from_secs(7))
        );
        // A date in the past: come back now.
        assert_eq!(
            parse(Some("Sun, 06 Nov 1994 08:49:00 GMT"), None, now),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn garbage_and_negatives_are_ignored() {
        let now = SystemTime::UNIX_EPOCH;
        assert_eq!(parse(Some("soon"), None, now), None);
        assert_eq!(parse(Some("-5"), Some("-1"), now), None);
        assert_eq!(parse(None, None, now), None);
    }
}
