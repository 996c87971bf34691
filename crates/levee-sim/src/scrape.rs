//! Scrapes Prometheus text endpoints during a run and keeps the named gauges.

use crate::exchange::HttpClient;
use crate::report::MetricSeries;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Largest `/metrics` page read (a vLLM page is tens of kilobytes).
const PAGE_LIMIT: usize = 8 * 1024 * 1024;

/// Sums of the wanted gauges over their label sets, from Prometheus text exposition.
///
/// Labels are summed because a gateway or vLLM reports one series per model or engine and
/// the report wants the total; a gauge absent from the page is absent from the result.
pub fn parse_gauges(text: &str, wanted: &[String]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !wanted.iter().any(|w| w == name) {
            continue;
        }
        // The value follows the closing brace of the labels (which may contain spaces).
        let rest = match line[name_end..].strip_prefix('{') {
            Some(labels) => labels.rfind('}').map_or("", |i| &labels[i + 1..]),
            None => &line[name_end..],
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if value.is_finite() {
            *out.entry(name.to_string()).or_insert(0.0) += value;
        }
    }
    out
}

async fn fetch(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let uri: http::Uri = url.parse()?;
    let request = http::Request::get(uri).body(Full::new(Bytes::new()))?;
    let response = tokio::time::timeout(Duration::from_secs(2), client.request(request)).await??;
    anyhow::ensure!(response.status().is_success(), "HTTP {}", response.status());
    let body = Limited::new(response.into_body(), PAGE_LIMIT)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Scrapes every source each `interval` until `stop`; returns one series per (source,
/// gauge) that was ever seen. A source that fails is logged once and retried next tick.
pub(crate) async fn run(
    client: HttpClient,
    sources: Vec<(String, String)>,
    gauges: Vec<String>,
    interval: Duration,
    start: Instant,
    stop: CancellationToken,
) -> Vec<MetricSeries> {
    let mut series: BTreeMap<(String, String), Vec<[f64; 2]>> = BTreeMap::new();
    if sources.is_empty() || gauges.is_empty() {
        return Vec::new();
    }
    let mut warned = vec![false; sources.len()];
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let t = start.elapsed().as_secs_f64();
        for (i, (name, url)) in sources.iter().enumerate() {
            match fetch(&client, url).await {
                Ok(text) => {
                    for (gauge, value) in parse_gauges(&text, &gauges) {
                        series
                            .entry((name.clone(), gauge))
                            .or_default()
                            .push([t, value]);
                    }
                }
                Err(e) => {
                    if !warned[i] {
                        tracing::warn!("cannot scrape {name} at {url}: {e:#} (will keep trying)");
                        warned[i] = true;
                    }
                }
            }
        }
    }
    series
        .into_iter()
        .map(|((source, name), points)| MetricSeries {
            source,
            name,
            points,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_label_sets_and_skips_comments() {
        let text = "# HELP vllm:num_requests_waiting waiting\n\
                    # TYPE vllm:num_requests_waiting gauge\n\
                    vllm:num_requests_waiting{model_name=\"a b\",engine=\"0\"} 3\n\
                    vllm:num_requests_waiting{model_name=\"c\"} 4.5\n\
                    vllm:kv_cache_usage_perc 0.25\n\
                    vllm:num_requests_running_total 99\n\
                    other 1\n";
        let wanted = vec![
            "vllm:num_requests_waiting".to_string(),
            "vllm:kv_cache_usage_perc".to_string(),
            "vllm:num_requests_running".to_string(),
        ];
        let got = parse_gauges(text, &wanted);
        assert_eq!(got.get("vllm:num_requests_waiting"), Some(&7.5));
        assert_eq!(got.get("vllm:kv_cache_usage_perc"), Some(&0.25));
        assert_eq!(got.get("vllm:num_requests_running"), None);
    }
}
