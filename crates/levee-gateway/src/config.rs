//! The gateway's configuration: TOML, every field defaulted, unknown fields refused.
//!
//! Parsing goes through `serde_path_to_error` so a type error names the exact path
//! (`models[1].backends[0].max_in_flight`); [`Config::validate`] then adds the semantic
//! checks a type system cannot make (unknown tier, missing fallback model, duplicate keys,
//! watermarks out of order). `levee config check` prints both kinds.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The whole configuration of one gateway.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the public and admin listeners bind.
    pub listen: ListenConfig,
    /// HTTP server limits: body size, header timeouts, deadlines, shutdown grace.
    pub server: ServerConfig,
    /// The per-IP guard that runs before authentication.
    pub ip_guard: IpGuardConfig,
    /// Tiers by name. A tier sets priority (0 is served first) and queue wait budget.
    pub tiers: BTreeMap<String, TierConfig>,
    /// Tenants: who may call, with which keys, in which tier, under which quotas.
    pub tenants: Vec<TenantConfig>,
    /// Limits shared by every tenant.
    pub limits: GlobalLimits,
    /// Rules that give long prompts and large `max_tokens` their own, tighter limit.
    pub heavy: HeavyConfig,
    /// Models and the backends that serve each.
    pub models: Vec<ModelConfig>,
    /// Queue watermarks and bounds.
    pub queue: QueueConfig,
    /// Circuit breaker settings applied to every backend.
    pub breaker: BreakerConfig,
    /// Outlier ejection: taking a failing backend out of routing at once.
    pub outlier: OutlierConfig,
    /// Degradation (load shedding short of refusal) settings.
    pub degrade: DegradeConfig,
    /// How often backends' Prometheus metrics are read.
    pub scrape: ScrapeConfig,
    /// KV-cache budgets of the backends.
    pub kv: KvConfig,
    /// Session affinity: a conversation's turns prefer the backend that holds its prefix.
    pub affinity: AffinityConfig,
    /// The response cache (for tenants with `response_cache = true`).
    pub cache: CacheConfig,
    /// Who may use the admin listener.
    pub admin: AdminConfig,
    /// The backend replica recommendation exported for autoscalers.
    pub autoscale: AutoscaleConfig,
    /// Request logs and metric cardinality.
    pub observe: ObserveConfig,
    /// Where limit state lives: this process (one replica) or Redis (a fleet).
    pub state: StateConfig,
    /// Async tasks (`/v1/tasks`): their durable store, band and callbacks.
    pub tasks: TasksConfig,
}

impl Default for Config {
    fn default() -> Self {
        let mut tiers = BTreeMap::new();
        tiers.insert(
            "premium".to_string(),
            TierConfig {
                priority: 0,
                queue_wait_ms: 30_000,
                soft_queue_wait_ms: 15_000,
                sheddable: false,
                queue_updates: false,
                ttft_slo_ms: None,
                slo_miss: SloMiss::Refuse,
                tpot_slo_ms: None,
            },
        );
        tiers.insert(
            "standard".to_string(),
            TierConfig {
                priority: 1,
                queue_wait_ms: 10_000,
                soft_queue_wait_ms: 2_000,
                sheddable: false,
                queue_updates: false,
                ttft_slo_ms: None,
                slo_miss: SloMiss::Refuse,
                tpot_slo_ms: None,
            },
        );
        tiers.insert(
            "free".to_string(),
            TierConfig {
                priority: 2,
                queue_wait_ms: 5_000,
                soft_queue_wait_ms: 0,
                sheddable: true,
                queue_updates: false,
                ttft_slo_ms: None,
                slo_miss: SloMiss::Refuse,
                tpot_slo_ms: None,
            },
        );
        Config {
            listen: ListenConfig::default(),
            server: ServerConfig::default(),
            ip_guard: IpGuardConfig::default(),
            tiers,
            tenants: Vec::new(),
            limits: GlobalLimits::default(),
            heavy: HeavyConfig::default(),
            models: Vec::new(),
            queue: QueueConfig::default(),
            breaker: BreakerConfig::default(),
            outlier: OutlierConfig::default(),
            degrade: DegradeConfig::default(),
            scrape: ScrapeConfig::default(),
            kv: KvConfig::default(),
            affinity: AffinityConfig::default(),
            cache: CacheConfig::default(),
            admin: AdminConfig::default(),
            autoscale: AutoscaleConfig::default(),
            observe: ObserveConfig::default(),
            state: StateConfig::default(),
            tasks: TasksConfig::default(),
        }
    }
}

/// Where the tenants' and the global request and token limits are decided.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StateBackend {
    /// In this process: limits hold per replica.
    #[default]
    Memory,
    /// In Redis or Valkey: limits hold for every replica sharing the server and prefix.
    Redis,
}

/// What a replica does while Redis does not answer within `timeout_ms`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// Keep serving: each replica enforces its share of each limit (limit ÷ live replicas,
    /// the count last seen in Redis) locally until Redis answers again.
    #[default]
    FailOpen,
    /// Refuse with 503 `shared_state_unavailable` until Redis answers again.
    FailClosed,
}

/// Shared state for many gateway replicas (`backend = "redis"`). Changing it takes a
/// restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StateConfig {
    /// `memory` (default) or `redis`.
    pub backend: StateBackend,
    /// The Redis server, `redis://host:port[/db]` (Redis Cluster is not supported yet).
    pub url: String,
    /// Prefix of every key levee writes; replicas of one fleet share it.
    pub key_prefix: String,
    /// The longest a limit decision waits for Redis before this replica switches to
    /// `on_failure` (milliseconds).
    pub timeout_ms: u64,
    /// `fail_open` (default) or `fail_closed`.
    pub on_failure: OnFailure,
    /// How often this replica reports itself alive, probes Redis and publishes its demand
    /// (milliseconds); a replica silent for three intervals no longer counts as live, and
    /// its leases and slices expire.
    pub heartbeat_ms: u64,
    /// How often this replica renews its slice of every backend's budget (milliseconds, at
    /// least 10; more than `heartbeat_ms` counts as `heartbeat_ms`): how soon the fleet moves room freed on one replica to a
    /// higher tier's requests waiting on another (see docs/replicas.md).
    pub slice_renew_ms: u64,
    /// This replica's name among its peers (empty: host name and process id).
    pub replica_id: String,
    /// Local batching: requests per slice of a tenant's budget taken from Redis at once
    /// and handed out here without a round trip (0 or 1: off). Never over-admits; the cost
    /// is that up to `replicas × (batch − 1)` requests of budget can sit unspent in other
    /// replicas' slices for up to one `heartbeat_ms` (see docs/replicas.md). Tenants with a
    /// `max_concurrency` are not batched (each request takes a lease).
    pub batch: u32,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            backend: StateBackend::Memory,
            url: "redis://127.0.0.1:6379".to_string(),
            key_prefix: "levee:".to_string(),
            timeout_ms: 25,
            on_failure: OnFailure::FailOpen,
            heartbeat_ms: 1000,
            slice_renew_ms: 100,
            replica_id: String::new(),
            batch: 0,
        }
    }
}

/// Listener addresses. Port 0 asks the OS for a free port (tests use this).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ListenConfig {
    /// The public, OpenAI-compatible listener.
    pub public: SocketAddr,
    /// The admin listener: metrics, state, degrade, drain, dashboard.
    pub admin: SocketAddr,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            public: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: SocketAddr::from(([127, 0, 0, 1], 9090)),
        }
    }
}

/// HTTP server settings that protect the gateway itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Largest accepted request body; larger bodies get 413.
    pub max_body_bytes: usize,
    /// A client must send its full header block within this time, or the connection is cut.
    pub header_read_timeout_ms: u64,
    /// Largest header block (bytes) the server buffers; larger ones are cut off.
    pub max_header_bytes: usize,
    /// Deadline for a backend's answer, counted from dispatch (time queued in levee never
    /// counts): the whole exchange for non-streaming requests, the response head for
    /// streaming ones.
    pub request_timeout_ms: u64,
    /// A stream whose backend sends nothing for this long is cut: the client gets an SSE
    /// error event, the backend slot and quota come back.
    pub stream_idle_timeout_ms: u64,
    /// Longest a stream may run, from dispatch; then it is cut as on an idle timeout.
    /// Must be at least `request_timeout_ms`.
    pub stream_timeout_ms: u64,
    /// After SIGTERM, in-flight requests get this long to finish (queued ones are answered
    /// 503 at once: a preStop `levee drain` is where they get to finish).
    pub shutdown_grace_ms: u64,
    /// A drain (`POST /admin/drain`, `levee drain`) first only stops advertising: `/readyz`
    /// answers 503 while requests are still served, for this long, so that load balancers
    /// and Kubernetes endpoints stop sending new ones. Then new requests get 503 +
    /// Retry-After while queued and in-flight ones finish.
    pub drain_grace_ms: u64,
    /// Completion tokens assumed when a request omits `max_tokens` (used for token
    /// estimates and limits before the real usage is known).
    pub default_max_tokens: u32,
    /// Retry-After given with 503s while draining or shutting down.
    pub drain_retry_after_ms: u64,
    /// A request body must arrive whole within this time from its headers, or the request
    /// is answered 408 `request_timeout` (a body that never finishes holds nothing longer).
    pub body_read_timeout_ms: u64,
    /// Client connections the public listener holds open at once; one more is closed at
    /// accept. 0 (the default): three quarters of what the process's open-file limit
    /// leaves after 128 descriptors, so that the descriptors backends, the shared store
    /// and the admin listener need are always left.
    pub max_connections: usize,
    /// Connections one client IP may hold open at once (0: no per-IP cap). Behind a load
    /// balancer every connection comes from its few addresses: raise it or set 0 there.
    pub max_connections_per_ip: usize,
    /// A connection (HTTP/1 keep-alive or HTTP/2) with no request in progress for this long
    /// is closed (HTTP/2: GOAWAY). A connection's first request must arrive within
    /// `header_read_timeout_ms`.
    pub idle_timeout_ms: u64,
    /// Requests one connection may carry; then it is closed once its last answer is sent
    /// (HTTP/1: `Connection: close`; HTTP/2: GOAWAY), and the client reconnects. 0: no limit.
    pub max_requests_per_connection: u64,
    /// Largest non-streamed answer levee buffers from a backend; a larger one is answered
    /// 502 `upstream_error` and its connection dropped. (A stream is passed on event by
    /// event, each event at most 1 MiB.)
    pub max_response_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: 1 << 20,
            header_read_timeout_ms: 5_000,
            max_header_bytes: 16 * 1024,
            request_timeout_ms: 300_000,
            stream_idle_timeout_ms: 60_000,
            stream_timeout_ms: 1_800_000,
            shutdown_grace_ms: 30_000,
            drain_grace_ms: 5_000,
            default_max_tokens: 256,
            drain_retry_after_ms: 5_000,
            body_read_timeout_ms: 30_000,
            max_connections: 0,
            max_connections_per_ip: 4_096,
            idle_timeout_ms: 60_000,
            max_requests_per_connection: 100_000,
            max_response_bytes: 64 << 20,
        }
    }
}

/// Per-client-IP request rate guard. It runs before authentication so floods of bad keys
/// cost one hash-map lookup each.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct IpGuardConfig {
    /// Turn the guard off (behind a trusted load balancer that already does this).
    pub enabled: bool,
    /// Sustained requests per second per IP.
    pub requests_per_second: f64,
    /// Burst allowance (requests) per IP.
    pub burst: u32,
}

impl Default for IpGuardConfig {
    fn default() -> Self {
        IpGuardConfig {
            enabled: true,
            requests_per_second: 1_000.0,
            burst: 2_000,
        }
    }
}

/// One tier: strict priority across tiers, a wait budget in the queue.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// 0 is served first; larger numbers wait behind smaller ones.
    pub priority: u8,
    /// Longest a request of this tier waits in the queue (load between the `safe` and
    /// `soft` watermarks) before `queue_timeout`.
    pub queue_wait_ms: u64,
    /// Longest wait when the load is between `soft` and `hard`; 0 refuses this tier there
    /// at once with `capacity_overload`.
    pub soft_queue_wait_ms: u64,
    /// Whether degradation level 3 may shed this tier.
    pub sheddable: bool,
    /// Streaming requests of this tier that wait in the queue get SSE comment lines
    /// (`: queued position=N eta_ms=M`) every second, as if each sent
    /// `x-levee-queue-updates: 1`. Once the first comment is out the status is 200, so a
    /// later refusal arrives as an SSE error event instead of a 429.
    pub queue_updates: bool,
    /// Time to first token objective of this tier (ms, as the client sees it: queue wait
    /// included). A request whose predicted time to first token — its predicted wait, then
    /// the time to first token learned for the backend with the prompt tokens being
    /// prefilled there — misses it even if admitted now is refused at once with 429
    /// `slo_unattainable` and a Retry-After of the predicted excess. Unset: no such refusal.
    pub ttft_slo_ms: Option<u64>,
    /// What a request predicted to miss `ttft_slo_ms` gets: `refuse` (429
    /// `slo_unattainable`), or `degrade`: a stored answer from the response cache when its
    /// tenant opted in and one is kept, else the model's `fallback` model (admitted there
    /// by that model's own checks), else the same refusal.
    pub slo_miss: SloMiss,
    /// Time per output token objective of this tier (ms). Each backend of a lane is held to
    /// the batch its learned slowdown allows under the tightest such objective of any tier
    /// (beside `max_in_flight` and KV tokens). Unset: no latency cap from this tier.
    pub tpot_slo_ms: Option<u64>,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            priority: 1,
            queue_wait_ms: 10_000,
            soft_queue_wait_ms: 2_000,
            sheddable: false,
            queue_updates: false,
            ttft_slo_ms: None,
            slo_miss: SloMiss::Refuse,
            tpot_slo_ms: None,
        }
    }
}

/// What a tier's request predicted to miss its time-to-first-token objective gets.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum SloMiss {
    /// 429 `slo_unattainable` with the predicted excess as Retry-After.
    #[default]
    Refuse,
    /// A cached answer, else the model's fallback model, else the refusal.
    Degrade,
}

/// One tenant: its keys, tier and quotas. A quota of 0 means unlimited.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TenantConfig {
    /// Unique tenant name (appears in metrics and admin state).
    pub name: String,
    /// Tier name; must be one of `[tiers]`.
    pub tier: String,
    /// SHA-256 of each API key, lowercase hex. The plain key never sits in the config.
    pub key_sha256: Vec<String>,
    /// Environment variables whose values are API keys (hashed at load).
    pub key_env: Vec<String>,
    /// Requests per minute (0 = unlimited).
    pub requests_per_minute: u32,
    /// Requests the tenant may send at once above its steady rate (0 = a whole minute's
    /// worth, `requests_per_minute`). A small burst holds a flooding tenant near its rate
    /// within seconds instead of after a minute.
    pub requests_burst: u32,
    /// LLM tokens (prompt + completion) per minute (0 = unlimited).
    pub tokens_per_minute: u64,
    /// Requests in flight or queued at once (0 = unlimited).
    pub max_concurrency: u32,
    /// Share of the tier's capacity under contention (fairness weight).
    pub weight: f64,
    /// Environment variable holding the secret that signs this tenant's task callbacks
    /// (HMAC-SHA256). Without it the tenant's tasks cannot ask for a `callback_url`.
    pub callback_secret_env: Option<String>,
    /// Keep this tenant's answers to deterministic requests and serve them, marked, when
    /// the model's lane is degraded past `cache.from_level` or no backend can serve.
    pub response_cache: bool,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            name: String::new(),
            tier: "standard".to_string(),
            key_sha256: Vec::new(),
            key_env: Vec::new(),
            requests_per_minute: 0,
            requests_burst: 0,
            tokens_per_minute: 0,
            max_concurrency: 0,
            weight: 1.0,
            callback_secret_env: None,
            response_cache: false,
        }
    }
}

/// Async tasks: `POST /v1/tasks` queues a chat or completion request durably and answers at
/// once with its id, place in line and ETA. Tasks run through the same admission path as
/// every other request, in `tier` (a configured tier, normally the lowest priority: the
/// batch band), at most `max_running` at a time, so they use idle capacity and yield to
/// interactive traffic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TasksConfig {
    /// Serve `/v1/tasks` (off: the routes answer 404).
    pub enabled: bool,
    /// The embedded store (redb file); created if missing, reopened after a restart. With
    /// `[state] backend = "redis"` tasks live in that Redis instead, and this is unused.
    pub store_path: std::path::PathBuf,
    /// The tier tasks are admitted in (must be one of `[tiers]`).
    pub tier: String,
    /// The band's width: tasks in the fair queue or at a backend at once, all models.
    pub max_running: u32,
    /// Tasks one tenant may have queued or running; one more is refused with 429.
    pub max_queued_per_tenant: u32,
    /// A task still queued this long after submission ends as `expired`.
    pub max_queue_ms: u64,
    /// Finished tasks (and their results) are kept this long, then removed.
    pub result_retention_ms: u64,
    /// The polling interval advised to clients (`poll_after_ms` and `Retry-After`).
    pub poll_interval_ms: u64,
    /// Attempts to deliver a callback before giving up.
    pub callback_attempts: u32,
    /// First retry delay of a callback; each retry doubles it, with full jitter.
    pub callback_backoff_ms: u64,
    /// Deadline of one callback POST.
    pub callback_timeout_ms: u64,
    /// Callbacks never reach loopback, private, link-local (cloud metadata), CGNAT,
    /// multicast or reserved addresses, judged after DNS resolution; these entries let
    /// internal receivers through: host names (as written in the `callback_url`), IP
    /// addresses or CIDRs (`"hooks.internal"`, `"10.20.0.0/16"`). Empty by default.
    pub callback_allow: Vec<String>,
    /// With `[state] backend = "redis"` (tasks shared by the fleet): a task held by a
    /// replica that stops renewing it for this long (it died, or hung) is claimed by
    /// another replica and run again there (milliseconds). A live replica renews what it
    /// holds every quarter of this, at most every 200 ms. Unused with the local store.
    pub visibility_ms: u64,
}

impl Default for TasksConfig {
    fn default() -> Self {
        TasksConfig {
            enabled: false,
            store_path: std::path::PathBuf::from("levee-tasks.redb"),
            tier: "batch".to_string(),
            max_running: 2,
            max_queued_per_tenant: 100,
            max_queue_ms: 3_600_000,
            result_retention_ms: 86_400_000,
            poll_interval_ms: 1_000,
            callback_attempts: 6,
            callback_backoff_ms: 500,
            callback_timeout_ms: 5_000,
            callback_allow: Vec::new(),
            visibility_ms: 30_000,
        }
    }
}

/// Limits that apply to everyone together. 0 means unlimited.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalLimits {
    /// Requests per minute across all tenants.
    pub requests_per_minute: u32,
    /// Tokens per minute across all tenants.
    pub tokens_per_minute: u64,
    /// Requests admitted (queued or in flight) at once across all tenants.
    pub max_concurrency: u32,
}

/// Heavy-request rules. A request is heavy when its estimated prompt or its `max_tokens`
/// passes a threshold; heavy requests also pass a per-tenant limit of their own.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct HeavyConfig {
    /// Estimated prompt tokens above which a request is heavy (0 = never).
    pub prompt_tokens_over: u64,
    /// `max_tokens` above which a request is heavy (0 = never).
    pub max_tokens_over: u64,
    /// Heavy requests per minute per tenant (0 = unlimited).
    pub requests_per_minute: u32,
    /// Heavy tokens per minute per tenant (0 = unlimited).
    pub tokens_per_minute: u64,
}

impl Default for HeavyConfig {
    fn default() -> Self {
        HeavyConfig {
            prompt_tokens_over: 8_000,
            max_tokens_over: 4_096,
            requests_per_minute: 10,
            tokens_per_minute: 0,
        }
    }
}

/// One model and the backends serving it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name clients send.
    pub name: String,
    /// Model to route to under degradation (must be another configured model).
    pub fallback: Option<String>,
    /// A canned assistant reply served (200, `x-levee-degraded: fallback_response`) instead
    /// of a 503 when no backend of this model can take requests (all breakers open, or none
    /// healthy). Unset: the 503 stands.
    pub fallback_response: Option<String>,
    /// Requests per minute for this model across tenants (0 = unlimited).
    pub requests_per_minute: u32,
    /// Tokens per minute for this model across tenants (0 = unlimited).
    pub tokens_per_minute: u64,
    /// Completion budget injected upstream (and counted) when a request gives no
    /// `max_tokens` (unset: `server.default_max_tokens`).
    pub default_max_tokens: Option<u32>,
    /// Longest prompt + completion one request may ask for. Unset: learned from the
    /// backends (vLLM's `max_model_len`, llama.cpp's per-slot `n_ctx`). Longer requests get
    /// 400 `context_length_exceeded` at once.
    pub max_context_tokens: Option<u64>,
    /// A Hugging Face `tokenizer.json` for counting prompt tokens exactly. Unset: about one
    /// token per CJK character and one per 4 other characters of message text (plus 4 per chat
    /// message and 2 per chat).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Time-to-first-token target (SLO). When set, the lane's P95 TTFT above 1.5× it raises
    /// the degradation level.
    pub ttft_slo_ms: Option<u64>,
    /// Count long prompts exactly by asking a backend (its `/tokenize`) before admission.
    /// Unset: every prompt is reserved by the estimate (corrected by what the engines
    /// counted lately).
    pub exact_count: Option<ExactCountConfig>,
    /// The backends; at least one.
    pub backends: Vec<BackendConfig>,
}

/// Exact prompt counts by the engine itself (`[models.exact_count]`): vLLM's `POST /tokenize`
/// (chat messages with tools, through the model's template), llama-server's
/// `POST /apply-template` then `POST /tokenize`. One call (two for llama-server) per long
/// prompt, to one routable backend of the model, before admission.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ExactCountConfig {
    /// Prompts whose corrected estimate is at least this many tokens are counted by the
    /// engine; shorter ones keep the estimate (its error is small in tokens).
    pub min_prompt_tokens: u64,
    /// How long a count may take; past it (or when the backend fails) the estimate stands.
    pub timeout_ms: u64,
}

impl Default for ExactCountConfig {
    fn default() -> Self {
        ExactCountConfig {
            min_prompt_tokens: 2_048,
            timeout_ms: 200,
        }
    }
}

/// The metrics dialect a backend speaks.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// vLLM (and the simulated engine): `vllm:num_requests_running` and friends.
    #[default]
    Vllm,
    /// llama.cpp's llama-server: `llamacpp:requests_processing` and friends.
    Llamacpp,
}

/// One upstream inference server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BackendConfig {
    /// Metrics dialect.
    pub kind: BackendKind,
    /// Base URL, e.g. `http://127.0.0.1:8000` or `https://llm.internal:8443` (the gateway
    /// appends `/v1/...`).
    pub url: String,
    /// Path of the active health check (`GET`, any 2xx passes). Empty: passive health only
    /// (no check; the backend leaves routing through its breaker and outlier ejection), for
    /// an engine without one, such as Ollama.
    pub health_path: String,
    /// Environment variable holding the backend's API key, sent as
    /// `Authorization: Bearer <key>` on every request levee makes to it. Read at load.
    pub api_key_env: Option<String>,
    /// Extra headers sent on every request to this backend (name → value).
    pub headers: BTreeMap<String, String>,
    /// PEM file of the certificate authorities an `https://` backend's certificate may chain
    /// to, besides the public ones (a private CA).
    pub ca_file: Option<PathBuf>,
    /// Most requests levee sends to this backend at once; more wait in levee's queue.
    pub max_in_flight: u32,
    /// KV-cache tokens of this backend: a request goes there only while the prompt +
    /// completion budgets of everything in flight there fit (less `kv.headroom`). Unset:
    /// learned from the engine (vLLM's `vllm:cache_config_info`, llama.cpp's `/props`);
    /// until known, only `max_in_flight` applies.
    pub max_kv_tokens: Option<u64>,
    /// Model name to send upstream, if it differs from the public name.
    pub upstream_model: Option<String>,
    /// Adapt the cap below `max_in_flight` from latency (time to first byte, gradient
    /// algorithm from levee-policy): the cap shrinks when the backend slows down.
    pub adaptive: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:8000".to_string(),
            health_path: "/health".to_string(),
            api_key_env: None,
            headers: BTreeMap::new(),
            ca_file: None,
            max_in_flight: 64,
            max_kv_tokens: None,
            upstream_model: None,
            adaptive: false,
        }
    }
}

impl BackendConfig {
    /// Checks the fields that shape requests to the backend: health path, API key, extra
    /// headers, CA file.
    fn check_upstream_settings(&self, bp: &str) -> Vec<String> {
        let mut errs = Vec::new();
        if !self.health_path.is_empty() && !self.health_path.starts_with('/') {
            errs.push(format!(
                "{bp}.health_path: {:?} must start with / (or be empty: passive health only)",
                self.health_path
            ));
        }
        if let Some(var) = &self.api_key_env {
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => {
                    if http::HeaderValue::from_str(&format!("Bearer {v}")).is_err() {
                        errs.push(format!(
                            "{bp}.api_key_env: the value of {var:?} cannot go in a header"
                        ));
                    }
                }
                _ => errs.push(format!(
                    "{bp}.api_key_env: environment variable {var:?} is not set or empty"
                )),
            }
        }
        for (name, value) in &self.headers {
            let hp = format!("{bp}.headers.{name}");
            match http::HeaderName::from_bytes(name.as_bytes()) {
                Err(_) => errs.push(format!("{hp}: not a valid header name")),
                Ok(n) if RESERVED_UPSTREAM_HEADERS.contains(&n.as_str()) => errs.push(format!(
                    "{hp}: levee sets this header itself (reserved: {})",
                    RESERVED_UPSTREAM_HEADERS.join(", ")
                )),
                Ok(n) if n == http::header::AUTHORIZATION && self.api_key_env.is_some() => {
                    errs.push(format!("{hp}: api_key_env sets authorization already"))
                }
                Ok(_) => {}
            }
            if http::HeaderValue::from_str(value).is_err() {
                errs.push(format!("{hp}: not a valid header value"));
            }
        }
        if let Some(path) = &self.ca_file {
            if !self.url.starts_with("https://") {
                errs.push(format!("{bp}.ca_file: only for an https:// url"));
            }
            if let Err(e) = read_ca_file(path) {
                errs.push(format!("{bp}.ca_file: {e}"));
            }
        }
        errs
    }
}

/// Headers levee writes on each upstream request itself; a backend's `headers` may not set
/// them.
pub const RESERVED_UPSTREAM_HEADERS: &[&str] = &[
    "host",
    "content-type",
    "content-length",
    "transfer-encoding",
    "connection",
    "x-request-id",
    "traceparent",
    "tracestate",
];

/// Watermarks over each model lane's load (its requests in flight plus those queued at the
/// same or a higher priority; every model has its own lane, so a flood on one model never
/// refuses another): below `safe` a request may wait its tier's `queue_wait_ms`, from
/// `safe` to `soft` too, from `soft` to `hard` only its tier's `soft_queue_wait_ms`, and at
/// `hard` it is refused with `capacity_overload`. A request whose wait, predicted from its
/// place in the queue and the lane's measured service time, exceeds its budget is refused
/// at once rather than left to time out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Below this the gateway is healthy.
    pub safe: u32,
    /// From here only the tiers' soft wait budgets apply.
    pub soft: u32,
    /// At this load nothing more is admitted (`capacity_overload`).
    pub hard: u32,
    /// Bound on the estimated tokens waiting in each lane's queue (0 = unbounded).
    pub max_queued_tokens: u64,
    /// How long after its last request a tenant still counts as active in a lane: while
    /// another tenant of its priority is active, one past its share (and burst allowance)
    /// must leave the others their waiting demand and a pooled burst headroom.
    pub fair_share_window_ms: u64,
    /// Priority aging inside a tier: a request that has waited this long goes before those
    /// of its tier that have not, oldest first, whatever its tenant's weight (0 = off).
    pub aging_ms: u64,
    /// Inside one tenant's backlog, its cheapest request (prompt + completion budget) of its
    /// 32 oldest goes first instead of its oldest (the order across tenants is unchanged).
    pub shortest_first: bool,
    /// Preemption inside a tier: while every slot of a model is busy and a tenant under its
    /// fair share has a request waiting, the youngest request of a tenant over its share
    /// whose answer has not started (a stream before its first event, its head held back
    /// until then; a non-streamed request before its whole answer) is cut short — its
    /// upstream request aborted — and queued again. A tenant over its share may then use
    /// the burst headroom it otherwise leaves idle for the others with its non-streamed
    /// requests, which can be taken back until they end. The cost: the engine's work on
    /// each request cut short (`levee_preempted_total`).
    pub preempt_over_share: bool,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            safe: 256,
            soft: 1_024,
            hard: 4_096,
            max_queued_tokens: 0,
            fair_share_window_ms: 60_000,
            aging_ms: 0,
            shortest_first: false,
            preempt_over_share: false,
        }
    }
}

/// Circuit breaker settings (one breaker per backend). Only backend failures count: 5xx,
/// connect errors, timeouts. A backend's own 429/503 is backpressure, not failure.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Sliding window for the failure rate.
    pub window_ms: u64,
    /// Buckets the window is split into.
    pub buckets: u32,
    /// The failure rate is judged only once the window holds this many requests.
    pub min_requests: u32,
    /// Failure rate (0..=1] at which the breaker opens.
    pub failure_rate: f64,
    /// Consecutive failures that open the breaker (0 = rule off).
    pub consecutive_failures: u32,
    /// How long the breaker stays open before letting a probe through.
    pub open_ms: u64,
    /// Probes allowed at once in half-open.
    pub half_open_probes: u32,
    /// Successful probes needed in half-open to close again.
    pub half_open_successes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window_ms: 10_000,
            buckets: 10,
            min_requests: 20,
            failure_rate: 0.5,
            consecutive_failures: 5,
            open_ms: 5_000,
            half_open_probes: 1,
            half_open_successes: 1,
        }
    }
}

/// Outlier ejection (as in Envoy): a backend that says it cannot serve, or fails
/// `consecutive_failures` times in a row, leaves routing at once, for the time it advises
/// (`Retry-After`) or for `base_ejection_ms` times the number of times it was ejected
/// recently, at most `max_ejection_ms`. Its breaker is held open for that time, so it comes
/// back through the breaker's half-open probes.
///
/// Backpressure is not failure: a 429, or a 503 with a `Retry-After` of at most
/// `backpressure_retry_after_ms` from a backend whose health check passes, only slows
/// routing down. A 503 without `Retry-After` (a crashed or restarting engine), a longer
/// one, or a refused connection ejects.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OutlierConfig {
    /// Outlier ejection on (off: only the breaker and health checks take backends out).
    pub enabled: bool,
    /// Failures in a row (5xx, broken connections, timeouts) that eject (0 = rule off).
    pub consecutive_failures: u32,
    /// Ejection time for the first ejection; the n-th recent ejection lasts n times this.
    pub base_ejection_ms: u64,
    /// Longest ejection, whatever the backend advises or the repeats add up to.
    pub max_ejection_ms: u64,
    /// A 503 with a `Retry-After` up to this, from a backend that passes its health check,
    /// is backpressure (slow down), not failure.
    pub backpressure_retry_after_ms: u64,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 3,
            base_ejection_ms: 5_000,
            max_ejection_ms: 60_000,
            backpressure_retry_after_ms: 2_000,
        }
    }
}

impl BreakerConfig {
    /// The policy crate's breaker settings.
    pub fn to_policy(&self) -> levee_policy::BreakerConfig {
        levee_policy::BreakerConfig {
            window: std::time::Duration::from_millis(self.window_ms),
            buckets: self.buckets,
            min_requests: self.min_requests,
            failure_rate: self.failure_rate,
            consecutive_failures: self.consecutive_failures,
            cooldown: std::time::Duration::from_millis(self.open_ms),
            half_open_probes: self.half_open_probes,
            success_threshold: self.half_open_successes,
        }
    }
}

/// Degradation: serve worse before refusing, per model lane. The load score is the largest
/// of the signals, each about 0..1: the lane's load over its `hard` watermark; its P95 TTFT
/// over 1.5× the model's `ttft_slo_ms` (when set); the share of its requests refused for
/// capacity; its KV-cache fill. A level is entered when the score reaches its `enter` and
/// left when it falls below its `exit` after `min_dwell_ms` (hysteresis: no flapping).
/// `/admin/degrade` can force a level.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DegradeConfig {
    /// Automatic degradation on (a forced level applies either way).
    pub enabled: bool,
    /// Least time at a level before stepping down one.
    pub min_dwell_ms: u64,
    /// Also use the lane's KV-cache fill (the larger of levee's reservations and the
    /// engines' own report, worst backend) as a load signal.
    pub kv_signal: bool,
    /// Also use the share of the lane's requests refused for capacity (over the last 10 s)
    /// as a load signal.
    pub refusal_signal: bool,
    /// Levels in increasing severity; `levels[0]` is level 1.
    pub levels: Vec<DegradeLevelConfig>,
}

impl Default for DegradeConfig {
    fn default() -> Self {
        DegradeConfig {
            enabled: true,
            min_dwell_ms: 5_000,
            kv_signal: true,
            refusal_signal: true,
            levels: vec![
                DegradeLevelConfig {
                    enter: 0.25,
                    exit: 0.15,
                    max_tokens_cap: Some(512),
                    use_fallback: false,
                    shed_from_priority: None,
                },
                DegradeLevelConfig {
                    enter: 0.5,
                    exit: 0.35,
                    max_tokens_cap: Some(256),
                    use_fallback: true,
                    shed_from_priority: None,
                },
                DegradeLevelConfig {
                    enter: 0.75,
                    exit: 0.6,
                    max_tokens_cap: Some(256),
                    use_fallback: true,
                    shed_from_priority: Some(2),
                },
            ],
        }
    }
}

/// One degradation level.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DegradeLevelConfig {
    /// Enter at or above this load score.
    pub enter: f64,
    /// Leave below this score (must be < `enter`).
    pub exit: f64,
    /// Cap each request's `max_tokens`.
    pub max_tokens_cap: Option<u32>,
    /// Route requests to their model's `fallback` (models without one are unchanged).
    pub use_fallback: bool,
    /// Shed (refuse with `capacity_overload`) tiers with this priority number or larger,
    /// when they are `sheddable`.
    pub shed_from_priority: Option<u8>,
}

impl Default for DegradeLevelConfig {
    fn default() -> Self {
        DegradeLevelConfig {
            enter: 1.0,
            exit: 0.9,
            max_tokens_cap: None,
            use_fallback: false,
            shed_from_priority: None,
        }
    }
}

impl DegradeConfig {
    /// The policy crate's planner settings.
    pub fn to_policy(&self) -> levee_policy::DegradeConfig {
        levee_policy::DegradeConfig {
            levels: self
                .levels
                .iter()
                .map(|l| levee_policy::DegradeLevel {
                    enter: l.enter,
                    exit: l.exit,
                    step: levee_policy::DegradeStep {
                        max_tokens_cap: l.max_tokens_cap,
                        use_fallback: l.use_fallback,
                        shed_from_tier: l.shed_from_priority.map(levee_policy::Tier),
                    },
                })
                .collect(),
            min_dwell: std::time::Duration::from_millis(self.min_dwell_ms),
        }
    }
}

/// Backend metrics scraping.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ScrapeConfig {
    /// Interval between scrapes of each backend's `/metrics` (0 = never scrape).
    pub interval_ms: u64,
    /// Scrape timeout; a backend that misses this many scrapes in a row is unhealthy.
    pub timeout_ms: u64,
    /// Failed scrapes in a row after which a backend counts as unhealthy.
    pub unhealthy_after: u32,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval_ms: 1_000,
            timeout_ms: 500,
            unhealthy_after: 3,
        }
    }
}

/// KV-cache budgets.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KvConfig {
    /// Share of each backend's KV budget levee keeps free (0.0..=0.9): room for the
    /// estimate's error and for the engine's own overheads.
    pub headroom: f64,
    /// A backend's reported KV use and queue correct levee's own count only this long
    /// after the scrape that read them.
    pub report_max_age_ms: u64,
    /// A streamed answer holds its prompt and the 99th percentile of the model's recent
    /// completions (once 32 were seen), not its whole `max_tokens`, and its hold grows
    /// ahead of its tokens as levee reads them; a stream whose backend has no room to grow
    /// it is cut with `stream_kv_budget`. Off: every request holds its whole `max_tokens`
    /// until it ends.
    pub grow_streams: bool,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            headroom: 0.05,
            report_max_age_ms: 3_000,
            grow_streams: true,
        }
    }
}

/// Session affinity with bounded load. A request's session is the value of
/// `session_header` when the client sends it, else a hash of its conversation's opening
/// (the messages up to and including the first user message), which every later turn
/// resends. A session goes back to the backend that served it last while that backend has
/// room and holds at most `⌈(1 + epsilon) ×` its capacity share of the lane's requests`⌉`;
/// else to the least-loaded backend.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AffinityConfig {
    /// Off by default: backends are chosen by load alone.
    pub enabled: bool,
    /// How far above its share of the lane's load a session's backend may go (≥ 0).
    pub epsilon: f64,
    /// The header naming a session (`""`: conversations are recognised by their opening
    /// messages only).
    pub session_header: String,
    /// Sessions remembered per model (the oldest are forgotten first).
    pub max_sessions: usize,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            enabled: false,
            epsilon: 0.25,
            session_header: "x-session-id".to_string(),
            max_sessions: 100_000,
        }
    }
}

/// The response cache: answers to deterministic requests (`temperature` 0, one choice) of
/// the tenants that opted in (`response_cache = true`), served marked
/// `x-levee-degraded: cache` when the model's lane is at degradation level `from_level` or
/// above, or when none of its backends can serve. Changing `max_bytes` or `ttl_ms` takes a
/// restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Most bytes of answers kept (least recently used out first; 0: nothing is kept).
    pub max_bytes: u64,
    /// An answer older than this is not served.
    pub ttl_ms: u64,
    /// The lane's degradation level from which stored answers are served instead of
    /// admitting the request (0: only when no backend can serve).
    pub from_level: u8,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_bytes: 64 << 20,
            ttl_ms: 600_000,
            from_level: 2,
        }
    }
}

/// The environment variable holding the admin token.
pub const ADMIN_TOKEN_ENV: &str = "LEVEE_ADMIN_TOKEN";

/// Admin listener security. Admin routes need `Authorization: Bearer <token>` when a token
/// is set (the `LEVEE_ADMIN_TOKEN` environment variable, or its SHA-256 here). Without a
/// token, an admin listener bound to loopback is open, and one bound elsewhere serves only
/// reads (`/metrics`, `/admin/state`) and refuses every action.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// SHA-256 of the admin token, lowercase hex (`printf %s TOKEN | sha256sum`). The
    /// `LEVEE_ADMIN_TOKEN` environment variable, when set, takes precedence.
    pub token_sha256: Option<String>,
    /// Without an admin token, the admin listener answers only requests whose `Host` is an
    /// IP address, `localhost`, or one of these names (a DNS-rebinding page's `Host` is its
    /// own name). Add the name Prometheus or an operator reaches it by, if not an address.
    pub hosts: Vec<String>,
}

/// The per-model backend replica recommendation (`levee_recommended_replicas`), from the
/// measured arrival rate, service rate and queue: Little's law and an M/M/c (Erlang C)
/// wait bound, plus a warm pool, limits and a scale-in hold.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscaleConfig {
    /// Fewest backend replicas recommended.
    pub min_replicas: u32,
    /// Most backend replicas recommended.
    pub max_replicas: u32,
    /// Idle replicas kept on top of the need, to absorb a burst while new ones start.
    pub warm_pool: u32,
    /// Busiest a backend slot (one of its `max_in_flight`) may be on average, in (0, 1].
    pub target_utilization: f64,
    /// Longest mean queue wait the M/M/c bound accepts.
    pub target_wait_ms: u64,
    /// The current queue must be served within this time (it adds queued / this to the
    /// arrival rate).
    pub drain_within_ms: u64,
    /// How long every figure must stay lower before the recommendation scales in.
    pub scale_in_hold_ms: u64,
    /// Window of the arrival and service rate measurements.
    pub window_ms: u64,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            min_replicas: 4,
            max_replicas: 32,
            warm_pool: 2,
            target_utilization: 0.8,
            target_wait_ms: 500,
            drain_within_ms: 60_000,
            scale_in_hold_ms: 300_000,
            window_ms: 10_000,
        }
    }
}

impl AutoscaleConfig {
    /// The policy crate's settings for a model whose replicas serve `slots` sequences each.
    pub fn to_policy(&self, slots: u32) -> levee_policy::AutoscaleConfig {
        levee_policy::AutoscaleConfig {
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            warm_pool: self.warm_pool,
            slots_per_replica: slots.max(1),
            target_utilization: self.target_utilization,
            target_wait: std::time::Duration::from_millis(self.target_wait_ms),
            drain_within: std::time::Duration::from_millis(self.drain_within_ms),
            scale_in_hold: std::time::Duration::from_millis(self.scale_in_hold_ms),
        }
    }
}

/// Request logs and metric cardinality.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ObserveConfig {
    /// Share of requests (0..=1) written as one JSON line each to standard output.
    pub request_log_sample: f64,
    /// Tenants (in config order) that get their own series in the per-tenant histograms;
    /// the others are counted under `tenant="other"`.
    pub max_tenant_series: usize,
    /// An OpenTelemetry collector's OTLP/HTTP base URL (`http://127.0.0.1:4318`): one trace
    /// per request is exported to `<url>/v1/traces` as protobuf. Needs a levee built with
    /// `--features otel`; read at start (a reload does not change it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

impl Default for ObserveConfig {
    fn default() -> Self {
        ObserveConfig {
            request_log_sample: 0.0,
            max_tenant_series: 50,
            otlp_endpoint: None,
        }
    }
}

/// Whether this build can export to `observe.otlp_endpoint`, and the URL is one it can use.
#[cfg(feature = "otel")]
fn check_otlp_endpoint(url: &str) -> Result<(), String> {
    match url.parse::<http::Uri>() {
        Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() => Ok(()),
        Ok(_) => Err(format!(
            "{url:?} must be an http:// URL with a host (the collector's OTLP/HTTP base URL, \
             such as http://127.0.0.1:4318)"
        )),
        Err(e) => Err(format!("{url:?} is not a URL: {e}")),
    }
}

#[cfg(not(feature = "otel"))]
fn check_otlp_endpoint(_url: &str) -> Result<(), String> {
    Err(
        "this levee was built without OpenTelemetry support; rebuild it with \
         `cargo build --release -p levee --features otel`, or remove the field"
            .to_string(),
    )
}

/// Hex SHA-256 of an API key, as stored in `key_sha256`.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl Config {
    /// Parses TOML text; errors name the path of the offending field.
    pub fn from_toml_str(text: &str) -> Result<Config, Vec<String>> {
        // toml's own message carries a line/column snippet; keep it, but lead with the path.
        let describe = |path: &str, e: &toml::de::Error| {
            let msg = e.message().to_string();
            let at = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                    format!(" (line {line})")
                })
                .unwrap_or_default();
            if path == "." || path.is_empty() {
                vec![format!("{msg}{at}")]
            } else {
                vec![format!("{path}: {msg}{at}")]
            }
        };
        let de = toml::Deserializer::parse(text).map_err(|e| describe("", &e))?;
        let cfg: Config = serde_path_to_error::deserialize(de)
            .map_err(|e| describe(&e.path().to_string(), e.inner()))?;
        let errors = cfg.validate();
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(errors)
        }
    }

    /// Reads and parses a file, then validates it, and refuses one a gateway could not
    /// serve with (see [`Config::check_serves`]): what `levee serve`, a reload and
    /// `levee config check` read.
    pub fn load(path: &Path) -> Result<Config, Vec<String>> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| vec![format!("cannot read {}: {e}", path.display())])?;
        let cfg = Config::from_toml_str(&text)?;
        let errs = cfg.check_serves();
        if errs.is_empty() {
            Ok(cfg)
        } else {
            Err(errs)
        }
    }

    /// What a configuration file must hold for a gateway to serve anyone: at least one
    /// model (each with a backend), at least one tenant, and two distinct listeners. An
    /// empty file (`: > levee.toml`) or one cut short by an editor or a half-written
    /// ConfigMap is valid TOML made of defaults; reloading it would answer every request
    /// 401 or 404, so it is refused with a line that says what is missing.
    pub fn check_serves(&self) -> Vec<String> {
        let mut errs = Vec::new();
        if self.models.is_empty() {
            errs.push(
                "models: no model is configured; the gateway would answer every request 404 \
                 (add a [[models]] with a [[models.backends]])"
                    .to_string(),
            );
        }
        if self.tenants.is_empty() {
            errs.push(
                "tenants: no tenant is configured; the gateway would answer every request 401 \
                 (add a [[tenants]] with its key)"
                    .to_string(),
            );
        }
        let (p, a) = (self.listen.public, self.listen.admin);
        if p == a && p.port() != 0 {
            errs.push(format!(
                "listen: the public and admin listeners are both {p}; the gateway needs two"
            ));
        }
        errs
    }

    /// Semantic checks; one line per problem, each starting with the field's path.
    pub fn validate(&self) -> Vec<String> {
        let mut errs = Vec::new();
        self.check_tiers(&mut errs);
        self.check_state(&mut errs);
        self.check_tenants(&mut errs);
        self.check_models(&mut errs);
        self.check_limits(&mut errs);
        self.check_server(&mut errs);
        self.check_tasks(&mut errs);
        self.check_affinity(&mut errs);
        errs
    }

    /// Session affinity: a sane ε, a valid header name, room for sessions.
    fn check_affinity(&self, errs: &mut Vec<String>) {
        let a = &self.affinity;
        if !a.epsilon.is_finite() || a.epsilon < 0.0 {
            errs.push(format!(
                "affinity.epsilon: {} must be a number ≥ 0",
                a.epsilon
            ));
        }
        if !a.session_header.is_empty()
            && http::HeaderName::from_bytes(a.session_header.as_bytes()).is_err()
        {
            errs.push(format!(
                "affinity.session_header: {:?} is not a valid header name",
                a.session_header
            ));
        }
        if a.enabled && a.max_sessions == 0 {
            errs.push("affinity.max_sessions: must be > 0 when affinity is enabled".to_string());
        }
        if self.cache.ttl_ms == 0 {
            errs.push("cache.ttl_ms: must be > 0".to_string());
        }
    }

    /// Tiers: at least one, each with its own priority and a wait.
    fn check_tiers(&self, errs: &mut Vec<String>) {
        if self.tiers.is_empty() {
            errs.push("tiers: at least one tier is required".to_string());
        }
        let mut priorities: BTreeMap<u8, &str> = BTreeMap::new();
        for (name, t) in &self.tiers {
            if let Some(other) = priorities.insert(t.priority, name) {
                errs.push(format!(
                    "tiers.{name}.priority: {} is also the priority of tier {other:?}; \
                     each tier needs its own",
                    t.priority
                ));
            }
            if t.queue_wait_ms == 0 {
                errs.push(format!(
                    "tiers.{name}.queue_wait_ms: must be > 0 (use a small value to refuse fast)"
                ));
            }
            for (field, v) in [
                ("ttft_slo_ms", t.ttft_slo_ms),
                ("tpot_slo_ms", t.tpot_slo_ms),
            ] {
                if v == Some(0) {
                    errs.push(format!("tiers.{name}.{field}: must be > 0 (or unset)"));
                }
            }
            if t.slo_miss == SloMiss::Degrade && t.ttft_slo_ms.is_none() {
                errs.push(format!(
                    "tiers.{name}.slo_miss: \"degrade\" acts on a predicted miss of \
                     ttft_slo_ms, which this tier does not set; set ttft_slo_ms or remove \
                     slo_miss"
                ));
            }
        }
    }

    /// The shared store's settings, when there is one.
    fn check_state(&self, errs: &mut Vec<String>) {
        if self.state.backend == StateBackend::Redis {
            if !self.state.url.starts_with("redis://") {
                errs.push(format!(
                    "state.url: {:?} is not a redis:// URL (TLS is not supported yet)",
                    self.state.url
                ));
            }
            if self.state.timeout_ms == 0 {
                errs.push("state.timeout_ms: must be > 0".to_string());
            }
            if self.state.heartbeat_ms < 50 {
                errs.push("state.heartbeat_ms: must be at least 50".to_string());
            }
            if self.state.slice_renew_ms < 10 {
                errs.push("state.slice_renew_ms: must be at least 10".to_string());
            }
        }
    }

    /// Tenants: names, tiers, weights, keys.
    fn check_tenants(&self, errs: &mut Vec<String>) {
        let mut tenant_names = HashSet::new();
        let mut seen_keys: BTreeMap<String, String> = BTreeMap::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let p = format!("tenants[{i}]");
            if t.name.is_empty() {
                errs.push(format!("{p}.name: must not be empty"));
            } else if !tenant_names.insert(t.name.clone()) {
                errs.push(format!("{p}.name: duplicate tenant name {:?}", t.name));
            }
            if !self.tiers.contains_key(&t.tier) {
                let known: Vec<&str> = self.tiers.keys().map(String::as_str).collect();
                errs.push(format!(
                    "{p}.tier: unknown tier {:?} (known tiers: {})",
                    t.tier,
                    known.join(", ")
                ));
            }
            if !(t.weight.is_finite() && t.weight > 0.0) {
                errs.push(format!("{p}.weight: must be a positive number"));
            }
            if t.key_sha256.is_empty() && t.key_env.is_empty() {
                errs.push(format!(
                    "{p}: no keys (set key_sha256 = [\"<sha256 hex>\"] or key_env = [\"VAR\"])"
                ));
            }
            for (j, k) in t.key_sha256.iter().enumerate() {
                let kp = format!("{p}.key_sha256[{j}]");
                let lower = k.to_ascii_lowercase();
                if lower.len() != 64 || !lower.bytes().all(|b| b.is_ascii_hexdigit()) {
                    errs.push(format!(
                        "{kp}: not a SHA-256 hex digest (64 hex characters); \
                         compute one with `printf %s KEY | sha256sum`"
                    ));
                    continue;
                }
                if let Some(prev) = seen_keys.insert(lower, kp.clone()) {
                    errs.push(format!("{kp}: duplicate key, already used at {prev}"));
                }
            }
            for (j, var) in t.key_env.iter().enumerate() {
                let kp = format!("{p}.key_env[{j}]");
                match std::env::var(var) {
                    Ok(v) if !v.is_empty() => {
                        if let Some(prev) = seen_keys.insert(hash_key(&v), kp.clone()) {
                            errs.push(format!("{kp}: duplicate key, already used at {prev}"));
                        }
                    }
                    _ => errs.push(format!(
                        "{kp}: environment variable {var:?} is not set or empty"
                    )),
                }
            }
        }
    }

    /// Models and their backends.
    fn check_models(&self, errs: &mut Vec<String>) {
        let model_names: HashSet<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        let mut seen_models = HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let p = format!("models[{i}]");
            if m.name.is_empty() {
                errs.push(format!("{p}.name: must not be empty"));
            } else if !seen_models.insert(m.name.as_str()) {
                errs.push(format!("{p}.name: duplicate model {:?}", m.name));
            }
            if let Some(fb) = &m.fallback {
                if fb == &m.name {
                    errs.push(format!("{p}.fallback: a model cannot fall back to itself"));
                } else if !model_names.contains(fb.as_str()) {
                    errs.push(format!(
                        "{p}.fallback: fallback model {fb:?} is not configured under [[models]]"
                    ));
                }
            }
            if let Some(path) = &m.tokenizer {
                if !path.is_file() {
                    errs.push(format!(
                        "{p}.tokenizer: {} is not a readable file (a Hugging Face tokenizer.json)",
                        path.display()
                    ));
                }
            }
            if let Some(x) = &m.exact_count {
                if x.timeout_ms == 0 || x.timeout_ms > 10_000 {
                    errs.push(format!(
                        "{p}.exact_count.timeout_ms: must be 1..=10000 (it delays admission \
                         of every long prompt by up to this), got {}",
                        x.timeout_ms
                    ));
                }
            }
            if m.backends.is_empty() {
                errs.push(format!("{p}.backends: at least one backend is required"));
            }
            let mut urls = HashSet::new();
            for (j, b) in m.backends.iter().enumerate() {
                let bp = format!("{p}.backends[{j}]");
                match b.url.parse::<http::Uri>() {
                    Ok(u)
                        if matches!(u.scheme_str(), Some("http" | "https"))
                            && u.authority().is_some() => {}
                    Ok(_) => errs.push(format!(
                        "{bp}.url: {:?} must be an http:// or https:// URL with a host",
                        b.url
                    )),
                    Err(e) => errs.push(format!("{bp}.url: {:?} is not a URL: {e}", b.url)),
                }
                errs.extend(b.check_upstream_settings(&bp));
                if !urls.insert(b.url.trim_end_matches('/')) {
                    errs.push(format!(
                        "{bp}.url: duplicate backend {:?} for this model",
                        b.url
                    ));
                }
                if b.max_in_flight == 0 {
                    errs.push(format!("{bp}.max_in_flight: must be > 0"));
                }
                if b.max_kv_tokens == Some(0) {
                    errs.push(format!(
                        "{bp}.max_kv_tokens: must be > 0 (leave it out to learn it from the engine)"
                    ));
                }
            }
        }
    }

    /// Watermarks, the per-IP guard, breaker, degradation, KV headroom, outlier ejection.
    fn check_limits(&self, errs: &mut Vec<String>) {
        let q = &self.queue;
        if !(q.safe < q.soft && q.soft < q.hard) {
            errs.push(format!(
                "queue: watermarks must satisfy safe < soft < hard (got safe={}, soft={}, hard={})",
                q.safe, q.soft, q.hard
            ));
        }
        if self.ip_guard.enabled
            && !(self.ip_guard.requests_per_second.is_finite()
                && self.ip_guard.requests_per_second > 0.0)
        {
            errs.push("ip_guard.requests_per_second: must be > 0 when enabled".to_string());
        }
        if let Err(e) = self.breaker.to_policy().validate() {
            errs.push(format!("breaker: {e}"));
        }
        if let Err(e) = self.degrade.to_policy().validate() {
            errs.push(e.to_string());
        }
        if !(0.0..=0.9).contains(&self.kv.headroom) {
            errs.push("kv.headroom: must be between 0.0 and 0.9".to_string());
        }
        let o = &self.outlier;
        if o.enabled && (o.base_ejection_ms == 0 || o.max_ejection_ms < o.base_ejection_ms) {
            errs.push(format!(
                "outlier: need 0 < base_ejection_ms <= max_ejection_ms (got {} and {})",
                o.base_ejection_ms, o.max_ejection_ms
            ));
        }
    }

    /// Server timeouts and sizes, admin token, autoscaling, observability.
    fn check_server(&self, errs: &mut Vec<String>) {
        let sv = &self.server;
        if sv.request_timeout_ms == 0 {
            errs.push("server.request_timeout_ms: must be > 0".to_string());
        }
        if sv.stream_idle_timeout_ms == 0 {
            errs.push("server.stream_idle_timeout_ms: must be > 0".to_string());
        }
        if sv.stream_timeout_ms < sv.request_timeout_ms {
            errs.push(format!(
                "server.stream_timeout_ms: {} is shorter than server.request_timeout_ms ({}), \
                 so a stream could be cut before its first byte was due; raise it",
                sv.stream_timeout_ms, sv.request_timeout_ms
            ));
        }
        if let Some(h) = &self.admin.token_sha256 {
            if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                errs.push(
                    "admin.token_sha256: not a SHA-256 hex digest (64 hex characters); \
                     compute one with `printf %s TOKEN | sha256sum`"
                        .to_string(),
                );
            }
        }
        if let Err(e) = self.autoscale.to_policy(1).validate() {
            errs.push(e.to_string());
        }
        if self.autoscale.window_ms == 0 {
            errs.push("autoscale.window_ms: must be > 0".to_string());
        }
        if !(0.0..=1.0).contains(&self.observe.request_log_sample) {
            errs.push(format!(
                "observe.request_log_sample: must be between 0 and 1, got {}",
                self.observe.request_log_sample
            ));
        }
        if let Some(url) = &self.observe.otlp_endpoint {
            if let Err(e) = check_otlp_endpoint(url) {
                errs.push(format!("observe.otlp_endpoint: {e}"));
            }
        }
        for (field, v) in [
            ("header_read_timeout_ms", self.server.header_read_timeout_ms),
            ("body_read_timeout_ms", self.server.body_read_timeout_ms),
            ("idle_timeout_ms", self.server.idle_timeout_ms),
        ] {
            if v == 0 {
                errs.push(format!("server.{field}: must be > 0"));
            }
        }
        if self.server.max_response_bytes == 0 {
            errs.push("server.max_response_bytes: must be > 0".to_string());
        }
        if self.server.max_body_bytes == 0 {
            errs.push("server.max_body_bytes: must be > 0".to_string());
        }
        if self.server.max_header_bytes < 8192 {
            // hyper refuses smaller read buffers; say so here rather than at bind time.
            errs.push("server.max_header_bytes: must be >= 8192".to_string());
        }
    }

    /// Async tasks and callback secrets.
    fn check_tasks(&self, errs: &mut Vec<String>) {
        let tk = &self.tasks;
        if tk.enabled {
            if !self.tiers.contains_key(&tk.tier) {
                let known: Vec<&str> = self.tiers.keys().map(String::as_str).collect();
                errs.push(format!(
                    "tasks.tier: unknown tier {:?} (known tiers: {}); add a [tiers.{}] with \
                     the lowest priority for the batch band",
                    tk.tier,
                    known.join(", "),
                    tk.tier
                ));
            }
            for (field, v) in [
                ("max_running", u64::from(tk.max_running)),
                ("max_queued_per_tenant", u64::from(tk.max_queued_per_tenant)),
                ("max_queue_ms", tk.max_queue_ms),
                ("poll_interval_ms", tk.poll_interval_ms),
                ("callback_timeout_ms", tk.callback_timeout_ms),
                ("visibility_ms", tk.visibility_ms),
            ] {
                if v == 0 {
                    errs.push(format!("tasks.{field}: must be > 0"));
                }
            }
            if self.state.backend == StateBackend::Memory && tk.store_path.as_os_str().is_empty() {
                errs.push("tasks.store_path: must name a file".to_string());
            }
        }
        if let Err(e) = crate::egress::EgressPolicy::new(&tk.callback_allow) {
            errs.push(format!("tasks.callback_allow: {e}"));
        }
        for (i, t) in self.tenants.iter().enumerate() {
            if let Some(var) = &t.callback_secret_env {
                if std::env::var(var).map_or(true, |v| v.is_empty()) {
                    errs.push(format!(
                        "tenants[{i}].callback_secret_env: environment variable {var:?} is not \
                         set or empty"
                    ));
                }
            }
        }
    }

    /// A short human summary for `levee config check`.
    pub fn summary(&self) -> String {
        let backends: usize = self.models.iter().map(|m| m.backends.len()).sum();
        let state = match self.state.backend {
            StateBackend::Memory => "limits in memory".to_string(),
            StateBackend::Redis => format!(
                "limits shared in Redis (prefix {:?})",
                self.state.key_prefix
            ),
        };
        format!(
            "public {} admin {}; {} tiers, {} tenants, {} models, {} backends; queue safe/soft/hard {}/{}/{}; {state}",
            self.listen.public,
            self.listen.admin,
            self.tiers.len(),
            self.tenants.len(),
            self.models.len(),
            backends,
            self.queue.safe,
            self.queue.soft,
            self.queue.hard
        )
    }
}

/// Reads the certificates of a PEM file (a backend's `ca_file`).
pub(crate) fn read_ca_file(
    path: &std::path::Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_round_trips_through_toml() {
        let cfg = Config::default();
        let text = toml::to_string(&cfg).unwrap();
        let back: Config = toml::from_str(&text).unwrap();
        assert_eq!(cfg, back);
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let errs = Config::from_toml_str(
            "[[models]]\nname = \"m\"\n[[models.backends]]\nurl = \"http://127.0.0.1:1\"\nmax_inflight = 3\n",
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1);
        assert!(errs[0].starts_with("models[0].backends[0]"), "{errs:?}");
        assert!(errs[0].contains("max_inflight"), "{errs:?}");
    }

    #[test]
    fn tasks_need_a_configured_tier_and_set_secrets() {
        let mut cfg = Config::default();
        cfg.tasks.enabled = true;
        cfg.tasks.max_running = 0;
        cfg.tenants.push(TenantConfig {
            name: "a".into(),
            key_sha256: vec![hash_key("k")],
            callback_secret_env: Some("LEVEE_TEST_UNSET_CALLBACK_SECRET".into()),
            ..TenantConfig::default()
        });
        let errs = cfg.validate();
        assert!(
            errs.iter()
                .any(|e| e.starts_with("tasks.tier: unknown tier \"batch\"")),
            "{errs:?}"
        );
        assert!(
            errs.iter().any(|e| e.starts_with("tasks.max_running")),
            "{errs:?}"
        );
        assert!(
            errs.iter()
                .any(|e| e.starts_with("tenants[0].callback_secret_env")),
            "{errs:?}"
        );
        cfg.tiers.insert(
            "batch".into(),
            TierConfig {
                priority: 3,
                ..TierConfig::default()
            },
        );
        cfg.tasks.max_running = 2;
        cfg.tenants[0].callback_secret_env = None;
        assert!(cfg.validate().is_empty(), "{:?}", cfg.validate());
        // Off, nothing about tasks is checked.
        cfg.tasks.enabled = false;
        cfg.tasks.tier = "nope".into();
        assert!(cfg.validate().is_empty());
    }

    #[test]
    fn wrong_type_is_named_with_its_path() {
        let errs = Config::from_toml_str("[queue]\nhard = \"lots\"\n").unwrap_err();
        assert!(errs[0].starts_with("queue.hard"), "{errs:?}");
    }

    #[test]
    fn a_latency_objective_of_zero_is_refused_and_one_set_reaches_the_tier() {
        let mut cfg = Config::default();
        if let Some(t) = cfg.tiers.get_mut("standard") {
            t.ttft_slo_ms = Some(0);
            t.tpot_slo_ms = Some(0);
        }
        let errs = cfg.validate().join("\n");
        assert!(
            errs.contains("tiers.standard.ttft_slo_ms: must be > 0"),
            "{errs}"
        );
        assert!(
            errs.contains("tiers.standard.tpot_slo_ms: must be > 0"),
            "{errs}"
        );
        let text = "[tiers.standard]\npriority = 1\nttft_slo_ms = 2000\ntpot_slo_ms = 100\n";
        let cfg = Config::from_toml_str(text).unwrap();
        let t = &cfg.tiers["standard"];
        assert_eq!((t.ttft_slo_ms, t.tpot_slo_ms), (Some(2000), Some(100)));
        assert_eq!(t.slo_miss, SloMiss::Refuse);
        // Degrading a miss of an objective the tier does not set would do nothing.
        let text = "[tiers.standard]\npriority = 1\nslo_miss = \"degrade\"\n";
        let errs = Config::from_toml_str(text).unwrap_err().join("\n");
        assert!(errs.contains("tiers.standard.slo_miss"), "{errs}");
        let text = format!("{text}ttft_slo_ms = 2000\n");
        let cfg = Config::from_toml_str(&text).unwrap();
        assert!(cfg.validate().is_empty(), "{:?}", cfg.validate());
        assert_eq!(cfg.tiers["standard"].slo_miss, SloMiss::Degrade);
    }

    #[test]
    fn semantic_errors_each_name_a_path() {
        let k = hash_key("k1");
        let text = format!(
            r#"
[queue]
safe = 10
soft = 5
hard = 20
[[tenants]]
name = "a"
tier = "gold"
key_sha256 = ["{k}"]
[[tenants]]
name = "b"
tier = "free"
key_sha256 = ["{k}"]
[[models]]
name = "m"
fallback = "nope"
[[models.backends]]
url = "http://127.0.0.1:1"
"#
        );
        let errs = Config::from_toml_str(&text).unwrap_err();
        let joined = errs.join("\n");
        assert!(
            joined.contains("tenants[0].tier: unknown tier \"gold\""),
            "{joined}"
        );
        assert!(
            joined.contains("tenants[1].key_sha256[0]: duplicate key"),
            "{joined}"
        );
        assert!(joined.contains("models[0].fallback"), "{joined}");
        assert!(joined.contains("safe < soft < hard"), "{joined}");
        assert_eq!(errs.len(), 4, "{joined}");
    }

    #[test]
    fn deadlines_and_ejection_times_must_make_sense() {
        let mut cfg = Config::default();
        cfg.server.request_timeout_ms = 60_000;
        cfg.server.stream_timeout_ms = 30_000;
        cfg.server.stream_idle_timeout_ms = 0;
        cfg.outlier.base_ejection_ms = 10_000;
        cfg.outlier.max_ejection_ms = 5_000;
        let errs = cfg.validate();
        let joined = errs.join("\n");
        assert!(
            joined.contains("server.stream_timeout_ms: 30000 is shorter"),
            "{joined}"
        );
        assert!(joined.contains("server.stream_idle_timeout_ms"), "{joined}");
        assert!(
            joined.contains("outlier: need 0 < base_ejection_ms"),
            "{joined}"
        );
        assert_eq!(errs.len(), 3, "{joined}");
        // Ejection settings are not judged while ejection is off.
        cfg.outlier.enabled = false;
        assert_eq!(cfg.validate().len(), 2);
    }

    #[test]
    fn otlp_endpoint_needs_the_otel_feature_and_an_http_url() {
        let mut cfg = Config::default();
        cfg.observe.otlp_endpoint = Some("http://127.0.0.1:4318".into());
        let errs = cfg.validate();
        if cfg!(feature = "otel") {
            assert!(errs.is_empty(), "{errs:?}");
            cfg.observe.otlp_endpoint = Some("grpc://collector".into());
            let errs = cfg.validate();
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert!(errs[0].starts_with("observe.otlp_endpoint: "), "{errs:?}");
        } else {
            assert_eq!(errs.len(), 1, "{errs:?}");
            assert!(errs[0].starts_with("observe.otlp_endpoint: "), "{errs:?}");
            assert!(errs[0].contains("--features otel"), "{errs:?}");
        }
    }

    #[test]
    fn redis_state_is_checked_only_when_used() {
        let mut cfg = Config::default();
        cfg.state.url = "http://nope".into();
        cfg.state.timeout_ms = 0;
        assert!(
            cfg.validate().is_empty(),
            "memory backend: [state] url unused"
        );
        cfg.state.backend = StateBackend::Redis;
        let errs = cfg.validate();
        let joined = errs.join("\n");
        assert!(
            joined.contains("state.url: \"http://nope\" is not a redis:// URL"),
            "{joined}"
        );
        assert!(joined.contains("state.timeout_ms: must be > 0"), "{joined}");
        let parsed = Config::from_toml_str(
            "[state]\nbackend = \"redis\"\non_failure = \"fail_closed\"\nbatch = 8\n",
        )
        .unwrap();
        assert_eq!(parsed.state.on_failure, OnFailure::FailClosed);
        assert_eq!(parsed.state.batch, 8);
        assert!(Config::from_toml_str("[state]\nbackend = \"etcd\"\n").is_err());
    }

    #[test]
    fn an_empty_or_truncated_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("levee-cfg-serves-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.toml");
        std::fs::write(&empty, "").unwrap();
        let errs = Config::load(&empty).unwrap_err();
        assert!(
            errs.iter().any(|e| e.starts_with("models: no model")),
            "{errs:?}"
        );
        assert!(
            errs.iter().any(|e| e.starts_with("tenants: no tenant")),
            "{errs:?}"
        );
        // The example cut before its first [[models]].
        let example = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../levee.example.toml"),
        )
        .unwrap();
        let cut = &example[..example.find("[[models]]").unwrap()];
        let truncated = dir.join("truncated.toml");
        std::fs::write(&truncated, cut).unwrap();
        let errs = Config::load(&truncated).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].starts_with("models: no model"), "{errs:?}");
        let mut cfg =
            Config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../levee.example.toml"))
                .unwrap();
        cfg.listen.admin = cfg.listen.public;
        assert!(cfg.check_serves()[0].starts_with("listen:"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../levee.example.toml");
        let cfg = Config::load(&path).unwrap();
        assert!(!cfg.models.is_empty());
    }
}
