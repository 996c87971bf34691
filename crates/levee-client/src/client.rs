use crate::{
    retry_after, Decision, Degradation, GiveUp, Outcome, RetryBudget, RetryBudgetConfig,
    RetryPolicy,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// Why a call through [`Client`] failed after the policy stopped retrying.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status and the policy would not retry it.
    #[error("{url} answered HTTP {status} after {attempts} attempt(s) ({reason:?}): {body}")]
    Status {
        /// The URL called.
        url: String,
        /// The last status.
        status: u16,
        /// Attempts made.
        attempts: u32,
        /// Why the client stopped.
        reason: GiveUp,
        /// The start of the last error body (it usually says what to change).
        body: String,
    },
    /// The last attempt got no response.
    #[error("{url}: no response after {attempts} attempt(s) ({reason:?}): {source}")]
    Transport {
        /// The URL called.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// Why the client stopped.
        reason: GiveUp,
        /// The transport error of the last attempt.
        #[source]
        source: reqwest::Error,
    },
}

/// A thin async client for OpenAI-compatible endpoints that applies a [`RetryPolicy`] and a
/// shared [`RetryBudget`] to every call.
///
/// One `Client` should be shared by all tasks of a process so that the budget covers all of
/// their traffic.
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    base_url: String,
    api_key: Option<String>,
    policy: RetryPolicy,
    budget: Mutex<RetryBudget>,
    rng: Mutex<SmallRng>,
}

impl Client {
    /// A client for `base_url` (e.g. `http://127.0.0.1:8080`), with a per-attempt `timeout`.
    /// `seed` makes the jitter repeatable; `None` seeds from the OS.
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        policy: RetryPolicy,
        budget: RetryBudgetConfig,
        timeout: Duration,
        seed: Option<u64>,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        let rng = match seed {
            Some(seed) => SmallRng::seed_from_u64(seed),
            None => rand::make_rng(),
        };
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key,
            policy,
            budget: Mutex::new(RetryBudget::new(budget, Instant::now())),
            rng: Mutex::new(rng),
        })
    }

    /// POSTs `body` to `/v1/chat/completions`, retrying per the policy, and returns the first
    /// successful (2xx) response. The response body is not read, so streaming works. An
    /// answer marked `x-levee-degraded` is final, success or not: read its measures with
    /// [`Degradation::from_headers`].
    pub async fn chat_completion(
        &self,
        body: &serde_json::Value,
    ) -> Result<reqwest::Response, ClientError> {
        self.post_json("/v1/chat/completions", body).await
    }

    /// POSTs `body` to `path` with retries; see [`Client::chat_completion`].
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<reqwest::Response, ClientError> {
        let url = format!("{}{}", self.base_url, path);
        if let Ok(mut budget) = self.budget.lock() {
            budget.on_request(Instant::now());
        }
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let mut request = self.http.post(&url).json(body);
            if let Some(key) = &self.api_key {
                request = request.bearer_auth(key);
            }
            let (outcome, wait, degraded, result) = match request.send().await {
                Ok(response) if response.status().is_success() => return Ok(response),
                Ok(response) => {
                    let wait = retry_after::from_headers(response.headers(), SystemTime::now());
                    let degraded = Degradation::from_headers(response.headers()).is_some();
                    (
                        Outcome::Status(response.status().as_u16()),
                        wait,
                        degraded,
                        Ok(response),
                    )
                }
                Err(e) if e.is_timeout() => (Outcome::Timeout, None, false, Err(e)),
                Err(e) => (Outcome::Connect, None, false, Err(e)),
            };
            let decision = self.decide(attempts, outcome, wait, degraded);
            match (decision, result) {
                (Decision::Retry(delay), _) => tokio::time::sleep(delay).await,
                (Decision::GiveUp(reason), Ok(response)) => {
                    let status = response.status().as_u16();
                    let mut body = response.text().await.unwrap_or_default();
                    body.truncate(512);
                    return Err(ClientError::Status {
                        url,
                        status,
                        attempts,
                        reason,
                        body,
                    });
                }
                (Decision::GiveUp(reason), Err(source)) => {
                    return Err(ClientError::Transport {
                        url,
                        attempts,
                        reason,
                        source,
                    })
                }
            }
        }
    }

    fn decide(
        &self,
        attempts: u32,
        outcome: Outcome,
        wait: Option<Duration>,
        degraded: bool,
    ) -> Decision {
        // A poisoned lock only means another task panicked mid-decision; the budget's
        // numbers are still valid, so keep using them.
        let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        self.policy.decide_marked(
            attempts,
            outcome,
            wait,
            degraded,
            &mut budget,
            Instant::now(),
            &mut *rng,
        )
    }
}
