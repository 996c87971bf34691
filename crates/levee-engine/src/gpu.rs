//! The GPU model: continuous batching over a KV cache, as pure logic over simulated time.
//!
//! No tokio, no clock: the caller passes the simulated time to every call, so the model can
//! be driven step by step in unit tests and by the scheduler task in the server.
//!
//! One step works like vLLM's scheduler:
//! 1. **Grow** the running batch: each running sequence needs one more KV slot for the token
//!    this step produces. If the cache cannot hold them, `preempt` mode evicts the newest
//!    running sequences (their KV is freed; they go back to the *front* of the queue and will
//!    be recomputed: prefill of prompt + tokens generated so far), `crash` mode fails every
//!    request and goes down for `restart_secs`.
//! 2. **Admit** from the waiting queue, first come first served, while a sequence slot is free,
//!    the step's prefill budget allows, and the cache holds the sequence's prompt (plus its
//!    generated tokens, when recomputing) and its first output token. Admission looks only at
//!    the cache *now*, not at how far the sequences will grow: that optimism is what makes a
//!    flood overflow the cache later. No admission happens in a step that preempted.
//! 3. The step lasts `prefill_us_per_token * prefilled_tokens + decode_base_ms +
//!    decode_per_seq_ms * batch` of simulated time (or the measured cost of that batch,
//!    `decode_ms_by_batch`, plus `prefill_base_ms` for each prompt the step prefills:
//!    [`GpuModel::begin_step`]); at its end
//!    ([`GpuModel::end_step`]) every sequence still running emits one token, and those that
//!    reached their length finish and free their KV.
//!
//! The KV cache is paged in blocks of [`KV_BLOCK_SIZE`] tokens, as vLLM's is: a sequence of
//! `prompt + generated` tokens (+1 reserved for the token in flight during a step) holds
//! `ceil(tokens / 16)` blocks, and every capacity decision (growth, admission, overflow) is
//! taken on blocks. A cancelled sequence leaves the queue or batch and frees its blocks at
//! once, even in the middle of a step.
//!
//! With [`GpuParams::prefix_caching`] (the default) the blocks a sequence leaves behind stay
//! cached ([`crate::kv`]): a prompt that starts with cached blocks takes them at admission
//! and prefills only the rest (its cached tokens cost `cached_prefill_cost` of a computed
//! one). At most `prompt − 1` tokens hit, so at least one token is computed.

use crate::config::{GpuParams, OverloadMode, KV_BLOCK_SIZE};
use crate::kv::BlockPool;
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Identifies one request (one sequence) inside an engine.
pub type SeqId = u64;

/// Why a request failed inside the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailReason {
    /// The engine crashed (simulated CUDA out of memory or an injected crash).
    Crash,
    /// The engine is down (restarting) and refuses new work.
    Unavailable,
    /// The engine is shutting down.
    Shutdown,
}

/// Something the model did that the server must pass on to a request or a metric.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The sequence entered the running batch (first time or after a preemption).
    Admitted {
        /// The sequence.
        id: SeqId,
        /// Tokens computed for it (prompt, plus generated tokens when recomputing), less
        /// those found in the prefix cache.
        prefill_tokens: u32,
        /// Tokens found in the prefix cache (not computed).
        cached_tokens: u32,
        /// True the first time, false when recomputing after a preemption.
        first: bool,
    },
    /// The sequence was evicted from the batch to make room; it waits to be recomputed.
    Preempted {
        /// The sequence.
        id: SeqId,
    },
    /// The sequence produced token number `index` (0-based).
    Token {
        /// The sequence.
        id: SeqId,
        /// Index of the token in the completion.
        index: u32,
        /// Simulated time from arrival to this token, when it is the first one.
        ttft: Option<Duration>,
    },
    /// The sequence produced all its tokens and left the engine.
    Finished {
        /// The sequence.
        id: SeqId,
        /// Completion tokens produced.
        generated: u32,
        /// Simulated time from arrival to the last token.
        e2e: Duration,
    },
    /// The sequence failed and left the engine.
    Failed {
        /// The sequence.
        id: SeqId,
        /// Why.
        reason: FailReason,
    },
    /// The engine crashed; `Failed` events for every request follow.
    Crashed {
        /// Requests that were in flight (running and waiting).
        in_flight: usize,
    },
    /// The engine came back from a crash, empty.
    Restarted,
}

/// Why the model refused a new sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The engine is down after a crash.
    Unavailable,
    /// prompt + completion exceeds `max_model_len`.
    TooLong {
        /// prompt + completion tokens requested.
        requested: u32,
        /// The limit.
        max_model_len: u32,
    },
    /// The sequence id is already in use.
    DuplicateId,
}

#[derive(Debug, Clone)]
struct Seq {
    prompt: u32,
    target: u32,
    generated: u32,
    /// KV tokens held now (0 while waiting).
    kv: u32,
    arrived: Duration,
    first_token: Option<Duration>,
    admitted_before: bool,
    /// Prefilled in the step running now; emits nothing at its end
    /// ([`GpuParams::first_token_next_step`]).
    prefilling: bool,
    /// Hashes of the full blocks of prompt + completion ([`crate::kv::block_hashes`]).
    hashes: Vec<u64>,
    /// Leading blocks taken from the prefix cache at admission (0 while waiting).
    shared: usize,
}

impl Seq {
    /// Gives back the sequence's blocks to `pool`: its full blocks are cached.
    fn release(&mut self, pool: &mut BlockPool) {
        let held = blocks(self.kv);
        let full = ((self.kv / KV_BLOCK_SIZE) as usize).min(self.hashes.len());
        let shared = self.shared.min(full);
        pool.release(
            &self.hashes[..shared],
            &self.hashes[shared..full],
            held - shared as u64,
        );
        self.kv = 0;
        self.shared = 0;
    }
}

/// Whether the engine serves or is down after a crash.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Health {
    /// Serving.
    Healthy,
    /// Down after a crash until the given simulated time.
    Crashed {
        /// Simulated time at which the engine comes back.
        until_secs: f64,
    },
}

/// A snapshot of the model's counters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuStats {
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences in the waiting queue (including preempted ones).
    pub waiting: usize,
    /// KV blocks held by running sequences.
    pub kv_used_blocks: u64,
    /// KV blocks in the cache.
    pub kv_blocks: u64,
    /// KV blocks cached for their prefix and held by no sequence (free for admission).
    pub kv_cached_blocks: u64,
    /// KV tokens held by running sequences, in whole blocks (`kv_used_blocks × 16`).
    pub kv_used_tokens: u64,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// Crashes so far.
    pub crashes: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Requests that produced all their tokens.
    pub completed: u64,
    /// Requests failed by a crash or a shutdown.
    pub failed: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Steps run.
    pub steps: u64,
    /// Sum of the simulated durations of all steps, in seconds.
    pub busy_secs: f64,
    /// Prompt tokens looked up in the prefix cache at admissions.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found.
    pub prefix_cache_hits: u64,
}

impl GpuStats {
    /// KV usage as a fraction of the blocks, 0..=1 (vLLM's `kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks == 0 {
            0.0
        } else {
            self.kv_used_blocks as f64 / self.kv_blocks as f64
        }
    }
}

/// Blocks that hold `tokens` tokens.
fn blocks(tokens: u32) -> u64 {
    u64::from(tokens.div_ceil(KV_BLOCK_SIZE))
}

/// Continuous batching over a KV cache, driven step by step in simulated time.
#[derive(Debug)]
pub struct GpuModel {
    params: GpuParams,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    /// Ids in `waiting` whose sequence was cancelled: removed lazily when they reach the
    /// front, so a mass cancellation of a long queue (clients timing out) costs O(n), not
    /// O(n²). Ids are never reused, so a stale id cannot be mistaken for a live one.
    stale_waiting: usize,
    /// Running sequences, oldest admitted first (preemption takes from the back).
    running: Vec<SeqId>,
    /// The KV cache's blocks.
    pool: BlockPool,
    prefix_queries: u64,
    prefix_hits: u64,
    health: Health,
    in_step: bool,
    crashes: u64,
    preemptions: u64,
    completed: u64,
    failed: u64,
    cancelled: u64,
    steps: u64,
    busy: Duration,
}

impl GpuModel {
    /// An empty, healthy engine.
    pub fn new(params: GpuParams) -> Self {
        Self {
            pool: BlockPool::new(u64::from(params.kv_blocks()), params.prefix_caching),
            params,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            stale_waiting: 0,
            running: Vec::new(),
            prefix_queries: 0,
            prefix_hits: 0,
            health: Health::Healthy,
            in_step: false,
            crashes: 0,
            preemptions: 0,
            completed: 0,
            failed: 0,
            cancelled: 0,
            steps: 0,
            busy: Duration::ZERO,
        }
    }

    /// The parameters the model runs with.
    pub fn params(&self) -> &GpuParams {
        &self.params
    }

    /// Whether the engine serves or is down.
    pub fn health(&self) -> Health {
        self.health
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> GpuStats {
        GpuStats {
            running: self.running.len(),
            waiting: self.waiting.len() - self.stale_waiting,
            kv_used_blocks: self.pool.used(),
            kv_blocks: u64::from(self.params.kv_blocks()),
            kv_cached_blocks: self.pool.cached(),
            kv_used_tokens: self.pool.used() * u64::from(KV_BLOCK_SIZE),
            kv_capacity_tokens: u64::from(self.params.kv_capacity_tokens),
            crashes: self.crashes,
            preemptions: self.preemptions,
            completed: self.completed,
            failed: self.failed,
            cancelled: self.cancelled,
            steps: self.steps,
            busy_secs: self.busy.as_secs_f64(),
            prefix_cache_queries: self.prefix_queries,
            prefix_cache_hits: self.prefix_hits,
        }
    }

    /// Whether a step could run now (someone is running or waiting and the engine is up).
    pub fn has_work(&self) -> bool {
        self.health == Health::Healthy
            && !(self.running.is_empty() && self.waiting.len() == self.stale_waiting)
    }

    /// When a crashed engine comes back, in simulated time.
    pub fn restart_at(&self) -> Option<Duration> {
        match self.health {
            Health::Healthy => None,
            Health::Crashed { until_secs } => Some(Duration::from_secs_f64(until_secs)),
        }
    }

    /// Queues a new sequence of `prompt` tokens that will generate `target` tokens.
    /// `arrived` is its arrival in simulated time (TTFT is measured from it). `hashes` are
    /// the block hashes of its prompt and completion tokens ([`crate::kv::block_hashes`]),
    /// the keys of the prefix cache (empty: nothing to share).
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt: u32,
        target: u32,
        arrived: Duration,
        hashes: Vec<u64>,
    ) -> Result<(), SubmitError> {
        if self.health != Health::Healthy {
            return Err(SubmitError::Unavailable);
        }
        let requested = prompt.saturating_add(target);
        if requested > self.params.max_model_len || target == 0 {
            return Err(SubmitError::TooLong {
                requested,
                max_model_len: self.params.max_model_len,
            });
        }
        if self.seqs.contains_key(&id) {
            return Err(SubmitError::DuplicateId);
        }
        self.seqs.insert(
            id,
            Seq {
                prompt,
                target,
                generated: 0,
                kv: 0,
                arrived,
                first_token: None,
                admitted_before: false,
                prefilling: false,
                hashes,
                shared: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Removes a sequence whose client went away, freeing its slot and KV at once.
    /// Returns false when the sequence is not in the engine (finished or failed already).
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return false;
        };
        if seq.kv > 0 {
            self.running.retain(|&r| r != id);
            seq.release(&mut self.pool);
        } else {
            self.stale_waiting += 1;
        }
        self.cancelled += 1;
        true
    }

    /// Starts a step at simulated time `now`: restarts a crashed engine whose time is up,
    /// grows the batch (preempting or crashing on overflow), admits waiting sequences, and
    /// returns how long the step lasts. `None` means no step runs (idle, or down).
    /// Call [`GpuModel::end_step`] at `now + duration`.
    pub fn begin_step(&mut self, now: Duration, events: &mut Vec<Event>) -> Option<Duration> {
        if let Health::Crashed { until_secs } = self.health {
            if now.as_secs_f64() >= until_secs {
                self.health = Health::Healthy;
                events.push(Event::Restarted);
            } else {
                return None;
            }
        }
        // 1. Grow: every running sequence needs one more slot for this step's token, and a
        // new block when its last one is full.
        let seqs = &self.seqs;
        let full = |id: &SeqId| seqs.get(id).is_some_and(|q| q.kv % KV_BLOCK_SIZE == 0);
        let mut need = self.running.iter().filter(|id| full(id)).count() as u64;
        let mut preempted_now = false;
        while need > self.pool.available() {
            match self.params.overload {
                OverloadMode::Crash => {
                    self.crash(now, events);
                    return None;
                }
                OverloadMode::Preempt => {
                    let Some(victim) = self.running.pop() else {
                        break;
                    };
                    if let Some(seq) = self.seqs.get_mut(&victim) {
                        if seq.kv % KV_BLOCK_SIZE == 0 {
                            need -= 1;
                        }
                        seq.release(&mut self.pool);
                    }
                    self.waiting.push_front(victim);
                    self.preemptions += 1;
                    preempted_now = true;
                    events.push(Event::Preempted { id: victim });
                }
            }
        }
        for id in &self.running {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.kv += 1;
            }
        }
        self.pool.allocate(need);
        // 2. Admit, unless this step had to preempt (vLLM does the same: no new prefill
        // while the running batch does not fit).
        let mut prefill_tokens: u64 = 0;
        let mut cached_tokens: u64 = 0;
        let mut prompts: u32 = 0;
        if !preempted_now {
            while let Some(&id) = self.waiting.front() {
                if self.running.len() >= self.params.max_running_seqs as usize {
                    break;
                }
                let Some(seq) = self.seqs.get_mut(&id) else {
                    self.waiting.pop_front();
                    self.stale_waiting -= 1;
                    continue;
                };
                let prefill = seq.prompt + seq.generated;
                // Leading blocks found in the prefix cache; at least one token is computed.
                let max_hit =
                    ((prefill.saturating_sub(1) / KV_BLOCK_SIZE) as usize).min(seq.hashes.len());
                let hits = self.pool.hits(&seq.hashes[..max_hit]);
                let cached = hits as u32 * KV_BLOCK_SIZE;
                let computed = prefill - cached;
                let budget = u64::from(self.params.max_batched_prefill_tokens);
                if prefill_tokens > 0 && prefill_tokens + u64::from(computed) > budget {
                    break;
                }
                let fresh = blocks(prefill + 1) - hits as u64;
                if self.pool.revived(&seq.hashes[..hits]) + fresh > self.pool.available() {
                    break;
                }
                self.waiting.pop_front();
                // The first token's KV slot is held from admission, unless that token comes
                // a step later: then the next step's growth adds it.
                let tail = self.params.first_token_next_step;
                seq.prefilling = tail;
                seq.kv = if tail { prefill } else { prefill + 1 };
                seq.shared = hits;
                self.pool
                    .acquire(&seq.hashes[..hits], blocks(seq.kv) - hits as u64);
                prefill_tokens += u64::from(computed);
                cached_tokens += u64::from(cached);
                if self.params.prefix_caching {
                    self.prefix_queries += u64::from(prefill);
                    self.prefix_hits += u64::from(cached);
                }
                prompts += 1;
                let first = !seq.admitted_before;
                seq.admitted_before = true;
                self.running.push(id);
                events.push(Event::Admitted {
                    id,
                    prefill_tokens: computed,
                    cached_tokens: cached,
                    first,
                });
            }
        }
        if self.running.is_empty() {
            return None;
        }
        // 3. Duration: prefill of the admitted prompts (their tokens, and each prompt's own
        // fixed cost: two prompts taken in together cost a real CPU engine twice one) plus
        // one decode over the batch.
        let prefilled =
            prefill_tokens as f64 + cached_tokens as f64 * self.params.cached_prefill_cost;
        let secs = prefilled * self.params.prefill_us_per_token * 1e-6
            + (f64::from(prompts) * self.params.prefill_base_ms
                + self.params.decode_ms(self.running.len()))
                * 1e-3;
        let duration = Duration::from_secs_f64(secs.max(0.0));
        self.in_step = true;
        self.steps += 1;
        self.busy += duration;
        Some(duration)
    }

    /// Ends the step begun by [`GpuModel::begin_step`] at simulated time `now`: every
    /// sequence still running emits one token; those that reach their length finish.
    pub fn end_step(&mut self, now: Duration, events: &mut Vec<Event>) {
        if !self.in_step {
            return;
        }
        self.in_step = false;
        let pool = &mut self.pool;
        let seqs = &mut self.seqs;
        let mut completed = 0;
        self.running.retain(|id| {
            let Some(seq) = seqs.get_mut(id) else {
                return false;
            };
            if seq.prefilling {
                seq.prefilling = false;
                return true;
            }
            let index = seq.generated;
            seq.generated += 1;
            let ttft = if seq.first_token.is_none() {
                seq.first_token = Some(now);
                Some(now.saturating_sub(seq.arrived))
            } else {
                None
            };
            events.push(Event::Token {
                id: *id,
                index,
                ttft,
            });
            if seq.generated >= seq.target {
                seq.release(pool);
                events.push(Event::Finished {
                    id: *id,
                    generated: seq.generated,
                    e2e: now.saturating_sub(seq.arrived),
                });
                completed += 1;
                seqs.remove(id);
                false
            } else {
                true
            }
        });
        self.completed += completed;
    }

    /// Crashes the engine now (a simulated CUDA out-of-memory, or an injected crash): every
    /// request in flight fails, and the engine is down for `restart_secs`.
    pub fn crash(&mut self, now: Duration, events: &mut Vec<Event>) {
        let in_flight = self.seqs.len();
        events.push(Event::Crashed { in_flight });
        self.fail_all(FailReason::Crash, events);
        self.crashes += 1;
        self.health = Health::Crashed {
            until_secs: now.as_secs_f64() + self.params.restart_secs,
        };
    }

    /// Fails every request in flight with `reason` and empties the engine.
    pub fn fail_all(&mut self, reason: FailReason, events: &mut Vec<Event>) {
        // Running first, then waiting in queue order: a stable order for tests and logs.
        for id in self.running.drain(..).chain(self.waiting.drain(..)) {
            if self.seqs.contains_key(&id) {
                events.push(Event::Failed { id, reason });
            }
        }
        self.stale_waiting = 0;
        self.failed += self.seqs.len() as u64;
        self.seqs.clear();
        // A crash or a shutdown wipes the GPU's memory: the prefix cache too.
        self.pool.clear();
        self.in_step = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineConfig;

    fn params() -> GpuParams {
        GpuParams {
            kv_capacity_tokens: 1024,
            max_running_seqs: 4,
            max_batched_prefill_tokens: 10_000,
            max_model_len: 1000,
            prefill_us_per_token: 100.0,
            decode_base_ms: 10.0,
            decode_per_seq_ms: 1.0,
            decode_ms_by_batch: Vec::new(),
            prefill_base_ms: 0.0,
            first_token_next_step: false,
            prefix_caching: false,
            cached_prefill_cost: 0.0,
            overload: OverloadMode::Preempt,
            restart_secs: 5.0,
        }
    }

    /// Drives the model until idle, checking invariants after every call; returns events.
    struct Driver {
        model: GpuModel,
        now: Duration,
        events: Vec<Event>,
        max_kv: u64,
    }

    impl Driver {
        fn new(params: GpuParams) -> Self {
            Self {
                model: GpuModel::new(params),
                now: Duration::ZERO,
                events: Vec::new(),
                max_kv: 0,
            }
        }

        fn step(&mut self) -> Option<Duration> {
            let d = self.model.begin_step(self.now, &mut self.events)?;
            self.check();
            self.now += d;
            self.model.end_step(self.now, &mut self.events);
            self.check();
            Some(d)
        }

        fn check(&mut self) {
            let s = self.model.stats();
            assert!(s.kv_used_blocks <= s.kv_blocks, "{s:?}");
            assert!(s.kv_used_tokens <= s.kv_capacity_tokens, "{s:?}");
            assert!(s.running <= self.model.params.max_running_seqs as usize);
            let sum: u64 = self.model.seqs.values().map(|q| blocks(q.kv)).sum();
            self.model.pool.check();
            // Shared cached blocks count once; without caching every block is one
            // sequence's.
            if self.model.params.prefix_caching {
                assert!(s.kv_used_blocks <= sum, "KV accounting drifted");
            } else {
                assert_eq!(sum, s.kv_used_blocks, "KV accounting drifted");
            }
            assert!(s.kv_used_blocks + s.kv_cached_blocks <= s.kv_blocks);
            assert_eq!(s.running + s.waiting, self.model.seqs.len());
            self.max_kv = self.max_kv.max(s.kv_used_tokens);
        }

        fn run_until_idle(&mut self) {
            for _ in 0..100_000 {
                if self.step().is_none() {
                    return;
                }
            }
            panic!("model did not go idle");
        }

        fn ttft(&self, id: SeqId) -> Duration {
            self.events
                .iter()
                .find_map(|e| match e {
                    Event::Token {
                        id: i,
                        ttft: Some(t),
                        ..
                    } if *i == id => Some(*t),
                    _ => None,
                })
                .unwrap()
        }
    }

    #[test]
    fn a_lone_request_costs_prefill_plus_one_decode_per_token() {
        let mut d = Driver::new(params());
        d.model
            .submit(1, 100, 3, Duration::ZERO, Vec::new())
            .unwrap();
        // First step: prefill 100 tokens (10 ms) + decode with batch 1 (11 ms).
        assert_eq!(d.step(), Some(Duration::from_millis(21)));
        assert_eq!(d.ttft(1), Duration::from_millis(21));
        assert_eq!(d.step(), Some(Duration::from_millis(11)));
        assert_eq!(d.step(), Some(Duration::from_millis(11)));
        assert_eq!(d.step(), None);
        let tokens: Vec<u32> = d
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Token { index, .. } => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(tokens, vec![0, 1, 2]);
        assert!(d.events.contains(&Event::Finished {
            id: 1,
            generated: 3,
            e2e: Duration::from_millis(43)
        }));
        let s = d.model.stats();
        assert_eq!(
            (s.completed, s.running, s.waiting, s.kv_used_tokens),
            (1, 0, 0, 0)
        );
    }

    #[test]
    fn decode_step_grows_with_batch_size() {
        let mut d = Driver::new(params());
        for id in 0..4 {
            d.model
                .submit(id, 10, 5, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.step();
        // Second step: pure decode with 4 sequences: 10 + 4 * 1 ms.
        assert_eq!(d.step(), Some(Duration::from_millis(14)));
    }

    #[test]
    fn a_measured_step_table_and_prefill_base_replace_the_line() {
        // A CPU engine: batch 1 costs 25 ms, 2 costs 55, 3 costs 70; past the table each
        // sequence adds decode_per_seq_ms (1 ms); each prompt a step prefills costs 20 ms
        // more.
        let mut p = params();
        p.decode_ms_by_batch = vec![25.0, 55.0, 70.0];
        p.prefill_base_ms = 20.0;
        assert_eq!(p.decode_ms(1), 25.0);
        assert_eq!(p.decode_ms(3), 70.0);
        assert_eq!(p.decode_ms(4), 71.0);
        let mut d = Driver::new(p);
        d.model
            .submit(1, 100, 5, Duration::ZERO, Vec::new())
            .unwrap();
        // Prefill 100 tokens (10 ms) + the prefill base (20 ms) + batch 1 (25 ms).
        assert_eq!(d.step(), Some(Duration::from_millis(55)));
        assert_eq!(d.ttft(1), Duration::from_millis(55));
        // A pure decode step pays neither prefill cost.
        assert_eq!(d.step(), Some(Duration::from_millis(25)));
        d.model.submit(2, 100, 3, d.now, Vec::new()).unwrap();
        // Batch 2 with a prefill: 10 + 20 + 55 ms.
        assert_eq!(d.step(), Some(Duration::from_millis(85)));
        assert_eq!(d.step(), Some(Duration::from_millis(55)));
        // Two prompts taken in by one step pay the base twice: 2 × (10 + 20) + batch 4
        // (71 ms).
        d.model.submit(3, 100, 3, d.now, Vec::new()).unwrap();
        d.model.submit(4, 100, 3, d.now, Vec::new()).unwrap();
        assert_eq!(d.step(), Some(Duration::from_millis(131)));
    }

    #[test]
    fn with_first_token_next_step_a_prompt_arriving_during_a_prefill_delays_the_first() {
        let mut p = params();
        p.first_token_next_step = true;
        let mut d = Driver::new(p);
        // A: prefill 100 tokens (10 ms) + batch 1 (11 ms); no token at its end.
        d.model
            .submit(1, 100, 3, Duration::ZERO, Vec::new())
            .unwrap();
        assert_eq!(d.step(), Some(Duration::from_millis(21)));
        assert!(!d.events.iter().any(|e| matches!(e, Event::Token { .. })));
        // B arrived during A's prefill: its prefill shares the step in which A's first token
        // comes out, so A waits for B's prefill (10 + 12 ms) as well as its own.
        d.model.submit(2, 100, 3, d.now, Vec::new()).unwrap();
        assert_eq!(d.step(), Some(Duration::from_millis(22)));
        assert_eq!(d.ttft(1), Duration::from_millis(43));
        // B's first token comes one step later (a decode of 2: 12 ms): 22 + 12 ms after it
        // arrived. Each still gets all its tokens.
        d.step();
        assert_eq!(d.ttft(2), Duration::from_millis(34));
        d.run_until_idle();
        let tokens = |id| {
            d.events
                .iter()
                .filter(|e| matches!(e, Event::Token { id: i, .. } if *i == id))
                .count()
        };
        assert_eq!((tokens(1), tokens(2)), (3, 3));
        // Without the rule A's first token comes out of its own prefill step.
        let mut d = Driver::new(params());
        d.model
            .submit(1, 100, 3, Duration::ZERO, Vec::new())
            .unwrap();
        d.step();
        d.model.submit(2, 100, 3, d.now, Vec::new()).unwrap();
        d.step();
        assert_eq!(d.ttft(1), Duration::from_millis(21));
    }

    #[test]
    fn ttft_rises_with_queue_length() {
        let mut d = Driver::new(params());
        // 12 identical requests, 4 run at once: the rest queue, and later ones wait longer.
        for id in 0..12 {
            d.model
                .submit(id, 50, 10, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.run_until_idle();
        let ttfts: Vec<Duration> = (0..12).map(|id| d.ttft(id)).collect();
        // Waves of 4: equal within a wave, strictly rising across waves.
        for wave in 0..3 {
            let w = &ttfts[wave * 4..wave * 4 + 4];
            assert!(w.iter().all(|t| *t == w[0]), "{ttfts:?}");
        }
        assert!(ttfts[0] < ttfts[4] && ttfts[4] < ttfts[8], "{ttfts:?}");
        assert_eq!(d.model.stats().completed, 12);
    }

    #[test]
    fn preempt_mode_never_exceeds_capacity_and_finishes_everything() {
        let mut p = params();
        p.kv_capacity_tokens = 300;
        p.max_model_len = 300;
        p.max_running_seqs = 16;
        let mut d = Driver::new(p);
        // Each request fits alone at admission (50 + 1) but 16 of them growing to 150
        // tokens need 2,400 slots: the model must preempt, and still finish all.
        for id in 0..16 {
            d.model
                .submit(id, 50, 100, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.run_until_idle();
        let s = d.model.stats();
        assert!(s.preemptions > 0, "{s:?}");
        assert_eq!(s.completed, 16);
        assert_eq!(s.crashes, 0);
        assert!(d.max_kv <= 300);
        // Every request got each token index exactly once, in order, despite preemption.
        for id in 0..16 {
            let idx: Vec<u32> = d
                .events
                .iter()
                .filter_map(|e| match e {
                    Event::Token { id: i, index, .. } if *i == id => Some(*index),
                    _ => None,
                })
                .collect();
            assert_eq!(idx, (0..100).collect::<Vec<_>>(), "seq {id}");
        }
        // Recompute re-prefills prompt + generated tokens.
        assert!(d.events.iter().any(|e| matches!(
            e,
            Event::Admitted { first: false, prefill_tokens, .. } if *prefill_tokens > 50
        )));
    }

    #[test]
    fn crash_mode_fails_everything_then_restarts_empty_after_restart_secs() {
        let mut p = params();
        p.kv_capacity_tokens = 300;
        p.max_model_len = 300;
        p.max_running_seqs = 16;
        p.overload = OverloadMode::Crash;
        let mut d = Driver::new(p);
        for id in 0..16 {
            d.model
                .submit(id, 50, 100, Duration::ZERO, Vec::new())
                .unwrap();
        }
        while d.step().is_some() {}
        let crash_at = d.now;
        let s = d.model.stats();
        assert_eq!(s.crashes, 1);
        assert_eq!(s.failed, 16);
        assert_eq!((s.running, s.waiting, s.kv_used_tokens), (0, 0, 0));
        assert!(d.max_kv <= 300);
        let failed = d
            .events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Event::Failed {
                        reason: FailReason::Crash,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(failed, 16);
        // Down: refuses work until restart_secs have passed.
        assert_eq!(
            d.model.submit(99, 10, 10, crash_at, Vec::new()),
            Err(SubmitError::Unavailable)
        );
        d.now = crash_at + Duration::from_millis(4_999);
        assert_eq!(d.step(), None);
        assert!(matches!(d.model.health(), Health::Crashed { .. }));
        d.now = crash_at + Duration::from_secs(5);
        assert_eq!(d.step(), None);
        assert_eq!(d.model.health(), Health::Healthy);
        assert!(d.events.contains(&Event::Restarted));
        d.model.submit(100, 10, 2, d.now, Vec::new()).unwrap();
        d.run_until_idle();
        assert_eq!(d.model.stats().completed, 1);
    }

    #[test]
    fn crash_mode_survives_when_demand_fits() {
        // The same engine in crash mode never crashes when concurrency is limited so that
        // sum(prompt + max output) fits: what a protecting gateway does.
        let mut p = params();
        p.kv_capacity_tokens = 320;
        p.max_model_len = 300;
        p.overload = OverloadMode::Crash;
        p.max_running_seqs = 2;
        let mut d = Driver::new(p);
        for id in 0..16 {
            d.model
                .submit(id, 50, 100, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.run_until_idle();
        assert_eq!(d.model.stats().crashes, 0);
        assert_eq!(d.model.stats().completed, 16);
    }

    #[test]
    fn cancel_frees_slot_and_kv_at_once() {
        let mut p = params();
        p.max_running_seqs = 1;
        let mut d = Driver::new(p);
        d.model
            .submit(1, 100, 1000 - 100, Duration::ZERO, Vec::new())
            .unwrap();
        d.model
            .submit(2, 10, 5, Duration::ZERO, Vec::new())
            .unwrap();
        d.step();
        assert_eq!(d.model.stats().running, 1);
        assert_eq!(d.model.stats().waiting, 1);
        // Mid-step cancel: the KV is freed before the step ends and no token is emitted.
        let started = d.model.begin_step(d.now, &mut d.events).unwrap();
        assert!(d.model.cancel(1));
        assert!(!d.model.cancel(1));
        let s = d.model.stats();
        assert_eq!((s.running, s.kv_used_tokens, s.cancelled), (0, 0, 1));
        d.now += started;
        let before = d.events.len();
        d.model.end_step(d.now, &mut d.events);
        assert_eq!(d.events.len(), before);
        // The waiting request is admitted on the next step.
        d.run_until_idle();
        assert_eq!(d.model.stats().completed, 1);
        // Cancelling a waiting request removes it from the queue.
        d.model.submit(3, 10, 5, d.now, Vec::new()).unwrap();
        assert!(d.model.cancel(3));
        assert_eq!(d.model.stats().waiting, 0);
    }

    #[test]
    fn prefill_budget_spreads_admission_over_steps() {
        let mut p = params();
        p.max_batched_prefill_tokens = 100;
        let mut d = Driver::new(p);
        for id in 0..3 {
            d.model
                .submit(id, 60, 5, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.step();
        assert_eq!(d.model.stats().running, 1);
        d.step();
        assert_eq!(d.model.stats().running, 2);
    }

    #[test]
    fn rejects_requests_longer_than_max_model_len() {
        let mut m = GpuModel::new(params());
        assert_eq!(
            m.submit(1, 900, 101, Duration::ZERO, Vec::new()),
            Err(SubmitError::TooLong {
                requested: 1001,
                max_model_len: 1000
            })
        );
        m.submit(1, 900, 100, Duration::ZERO, Vec::new()).unwrap();
        assert_eq!(
            m.submit(1, 1, 1, Duration::ZERO, Vec::new()),
            Err(SubmitError::DuplicateId)
        );
    }

    #[test]
    fn injected_crash_fails_in_flight_requests() {
        let mut d = Driver::new(params());
        d.model
            .submit(1, 10, 50, Duration::ZERO, Vec::new())
            .unwrap();
        d.step();
        let mut ev = Vec::new();
        d.model.crash(d.now, &mut ev);
        assert!(ev.contains(&Event::Failed {
            id: 1,
            reason: FailReason::Crash
        }));
        assert_eq!(d.model.stats().crashes, 1);
    }

    #[test]
    fn zero_profile_steps_take_no_time() {
        let mut d = Driver::new(EngineConfig::zero().gpu);
        d.model
            .submit(1, 1000, 4, Duration::ZERO, Vec::new())
            .unwrap();
        assert_eq!(d.step(), Some(Duration::ZERO));
    }

    #[test]
    fn a_sequence_holds_whole_blocks() {
        let mut d = Driver::new(params());
        d.model
            .submit(1, 20, 14, Duration::ZERO, Vec::new())
            .unwrap();
        // Admitted with its prompt and first token: 21 tokens, 2 blocks.
        d.step();
        let s = d.model.stats();
        assert_eq!(
            (s.kv_used_blocks, s.kv_used_tokens, s.kv_blocks),
            (2, 32, 64)
        );
        assert_eq!(s.kv_usage(), 2.0 / 64.0);
        // 32 tokens still fit in 2 blocks; the 33rd takes a third.
        for _ in 0..11 {
            d.step();
        }
        assert_eq!(d.model.stats().kv_used_blocks, 2);
        d.step();
        assert_eq!(d.model.stats().kv_used_blocks, 3);
        d.run_until_idle();
        assert_eq!(d.model.stats().kv_used_blocks, 0);
    }

    #[test]
    fn admission_is_decided_on_blocks() {
        // 4 blocks (64 tokens). Three prompts of 17 tokens need 18 tokens each: 54 tokens
        // would fit, but each needs 2 blocks, so only two are admitted.
        let mut p = params();
        p.kv_capacity_tokens = 64;
        p.max_model_len = 64;
        let mut d = Driver::new(p);
        for id in 0..3 {
            d.model
                .submit(id, 17, 3, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.step();
        let s = d.model.stats();
        assert_eq!((s.running, s.waiting, s.kv_used_blocks), (2, 1, 4));
        d.run_until_idle();
        assert_eq!(d.model.stats().completed, 3);
    }

    #[test]
    fn crash_mode_overflows_on_blocks_not_tokens() {
        // 3 blocks (48 tokens). Two prompts of 15 tokens are admitted with 16 tokens each
        // (one block each); the next step takes each to 17 tokens: 34 tokens would fit in
        // 48, but two new blocks make 4 > 3.
        let mut p = params();
        p.kv_capacity_tokens = 48;
        p.max_model_len = 48;
        p.overload = OverloadMode::Crash;
        let mut d = Driver::new(p);
        for id in 0..2 {
            d.model
                .submit(id, 15, 10, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.step();
        assert_eq!(d.model.stats().kv_used_blocks, 2);
        assert_eq!(d.step(), None);
        assert_eq!(d.model.stats().crashes, 1);
        // In preempt mode the newest is evicted instead, and both finish.
        let mut p = params();
        p.kv_capacity_tokens = 48;
        p.max_model_len = 48;
        let mut d = Driver::new(p);
        for id in 0..2 {
            d.model
                .submit(id, 15, 10, Duration::ZERO, Vec::new())
                .unwrap();
        }
        d.run_until_idle();
        let s = d.model.stats();
        assert!(s.preemptions >= 1, "{s:?}");
        assert_eq!((s.completed, s.crashes), (2, 0));
    }

    /// Block hashes of a request whose prompt and completion are `tokens` tokens of the
    /// conversation `conv` (equal conversations share every block).
    fn conv(conv: u64, tokens: u32) -> Vec<u64> {
        (0..u64::from(tokens / KV_BLOCK_SIZE))
            .map(|k| conv * 1_000 + k)
            .collect()
    }

    fn caching() -> GpuParams {
        let mut p = params();
        p.prefix_caching = true;
        p
    }

    #[test]
    fn a_cached_prefix_skips_its_prefill_and_is_reported() {
        let mut d = Driver::new(caching());
        // Cold: 100 prompt tokens prefilled (10 ms) + decode (11 ms).
        d.model
            .submit(1, 100, 20, Duration::ZERO, conv(7, 120))
            .unwrap();
        assert_eq!(d.step(), Some(Duration::from_millis(21)));
        d.run_until_idle();
        // Its 7 full blocks (112 tokens of prompt and completion) stay cached.
        let s = d.model.stats();
        assert_eq!((s.kv_used_blocks, s.kv_cached_blocks), (0, 7));
        // The next turn: the same 120 tokens and 60 more. Its first 7 blocks are hits: 112
        // tokens cached, 68 computed (6.8 ms).
        d.events.clear();
        d.model.submit(2, 180, 5, d.now, conv(7, 185)).unwrap();
        assert_eq!(d.step(), Some(Duration::from_micros(6_800 + 11_000)));
        assert!(d.events.contains(&Event::Admitted {
            id: 2,
            prefill_tokens: 68,
            cached_tokens: 112,
            first: true,
        }));
        let s = d.model.stats();
        assert_eq!(
            (s.prefix_cache_queries, s.prefix_cache_hits),
            (100 + 180, 112)
        );
        // Another conversation misses.
        d.run_until_idle();
        d.events.clear();
        d.model.submit(3, 180, 5, d.now, conv(8, 185)).unwrap();
        d.step();
        assert!(d.events.iter().any(|e| matches!(
            e,
            Event::Admitted {
                id: 3,
                cached_tokens: 0,
                prefill_tokens: 180,
                ..
            }
        )));
    }

    #[test]
    fn at_least_one_token_is_computed_and_cached_tokens_may_cost_a_fraction() {
        let mut p = caching();
        p.cached_prefill_cost = 0.5;
        let mut d = Driver::new(p);
        d.model
            .submit(1, 64, 16, Duration::ZERO, conv(1, 80))
            .unwrap();
        d.run_until_idle();
        // The same 64-token prompt again: 3 of its 4 blocks hit (the last token is always
        // computed): 48 cached at half cost + 16 computed = 40 token-costs (4 ms).
        d.events.clear();
        d.model.submit(2, 64, 16, d.now, conv(1, 80)).unwrap();
        assert_eq!(d.step(), Some(Duration::from_micros(4_000 + 11_000)));
        assert!(d.events.iter().any(|e| matches!(
            e,
            Event::Admitted {
                id: 2,
                cached_tokens: 48,
                prefill_tokens: 16,
                ..
            }
        )));
    }

    #[test]
    fn cached_blocks_are_free_for_admission_and_evicted_least_recently_released_first() {
        // 8 blocks. Two conversations of 3 blocks each finish: 6 cached, 0 in use.
        let mut p = caching();
        p.kv_capacity_tokens = 128;
        p.max_model_len = 128;
        let mut d = Driver::new(p);
        d.model
            .submit(1, 40, 8, Duration::ZERO, conv(1, 48))
            .unwrap();
        d.run_until_idle();
        d.model.submit(2, 40, 8, d.now, conv(2, 48)).unwrap();
        d.run_until_idle();
        assert_eq!(d.model.stats().kv_cached_blocks, 6);
        // A new 40-token prompt needs 3 blocks: only 2 are free, but cached ones count as
        // free, so it is admitted and evicts the least recently released one: conversation
        // 1's first block.
        d.model.submit(3, 40, 1, d.now, conv(3, 41)).unwrap();
        d.step();
        assert_eq!(d.model.stats().completed, 3);
        // Conversation 2 still hits (2 blocks: its last token is computed); conversation 1
        // misses, its first block gone.
        d.events.clear();
        d.model.submit(4, 47, 1, d.now, conv(2, 48)).unwrap();
        d.model.submit(5, 47, 1, d.now, conv(1, 48)).unwrap();
        d.run_until_idle();
        let cached = |id| {
            d.events.iter().find_map(|e| match e {
                Event::Admitted {
                    id: i,
                    cached_tokens,
                    ..
                } if *i == id => Some(*cached_tokens),
                _ => None,
            })
        };
        assert_eq!((cached(4), cached(5)), (Some(32), Some(0)));
    }

    #[test]
    fn a_preempted_sequence_finds_its_own_blocks_again_and_a_crash_wipes_the_cache() {
        let mut p = caching();
        p.kv_capacity_tokens = 320;
        p.max_model_len = 300;
        p.max_running_seqs = 16;
        let mut d = Driver::new(p);
        for id in 0..8 {
            d.model
                .submit(id, 50, 100, Duration::ZERO, conv(id, 150))
                .unwrap();
        }
        d.run_until_idle();
        let s = d.model.stats();
        assert!(s.preemptions > 0, "{s:?}");
        assert_eq!(s.completed, 8);
        // A recomputed sequence took back some of the blocks it had left.
        assert!(d.events.iter().any(|e| matches!(
            e,
            Event::Admitted { first: false, cached_tokens, .. } if *cached_tokens > 0
        )));
        assert!(s.kv_cached_blocks > 0);
        let mut ev = Vec::new();
        d.model.crash(d.now, &mut ev);
        assert_eq!(d.model.stats().kv_cached_blocks, 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Submit {
            prompt: u32,
            target: u32,
            family: u64,
        },
        Cancel(u64),
        Step,
        Crash,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            10 => (1u32..120, 1u32..80, 0u64..4)
                .prop_map(|(prompt, target, family)| Op::Submit { prompt, target, family }),
            3 => (0u64..60).prop_map(Op::Cancel),
            26 => Just(Op::Step),
            1 => Just(Op::Crash),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

        /// Under any interleaving of submissions, cancellations, steps and crashes: KV stays
        /// within capacity (preempt mode never crashes on its own), accounting never drifts,
        /// each request gets its tokens in order with no gaps, and every request ends exactly
        /// once (finished, cancelled or failed).
        #[test]
        fn model_invariants_hold(
            ops in proptest::collection::vec(op(), 1..200),
            capacity in 200u32..600,
            max_seqs in 1u32..12,
            crash_mode in proptest::bool::ANY,
            first_token_next_step in proptest::bool::ANY,
            caching in proptest::bool::ANY,
        ) {
            let mut p = params();
            p.first_token_next_step = first_token_next_step;
            p.prefix_caching = caching;
            p.kv_capacity_tokens = capacity;
            p.max_model_len = 200;
            p.max_running_seqs = max_seqs;
            p.overload = if crash_mode { OverloadMode::Crash } else { OverloadMode::Preempt };
            let mut d = Driver::new(p);
            let mut next = 0u64;
            let mut ended: HashMap<SeqId, &str> = HashMap::new();
            let mut next_index: HashMap<SeqId, u32> = HashMap::new();
            let mut injected_crashes = 0;
            for op in ops {
                match op {
                    Op::Submit { prompt, target, family } => {
                        // Requests of one family share their leading blocks.
                        let hashes = (0..u64::from((prompt + target) / KV_BLOCK_SIZE))
                            .map(|k| family * 1000 + k)
                            .collect();
                        if d.model.submit(next, prompt, target, d.now, hashes).is_ok() {
                            next_index.insert(next, 0);
                        }
                        next += 1;
                    }
                    Op::Cancel(id) => {
                        if d.model.cancel(id) {
                            assert!(ended.insert(id, "cancelled").is_none());
                        }
                    }
                    Op::Step => {
                        if d.step().is_none() {
                            d.now += Duration::from_secs(1);
                        }
                    }
                    Op::Crash => {
                        if d.model.health() == Health::Healthy {
                            injected_crashes += 1;
                            d.model.crash(d.now, &mut d.events);
                        }
                    }
                }
                d.check();
                for e in d.events.drain(..) {
                    match e {
                        Event::Token { id, index, .. } => {
                            let expect = next_index.get_mut(&id).unwrap();
                            assert_eq!(index, *expect, "token gap for {id}");
                            *expect += 1;
                            assert!(!ended.contains_key(&id));
                        }
                        Event::Finished { id, generated, .. } => {
                            assert_eq!(next_index[&id], generated);
                            assert!(ended.insert(id, "finished").is_none());
                        }
                        Event::Failed { id, .. } => {
                            assert!(ended.insert(id, "failed").is_none());
                        }
                        _ => {}
                    }
                }
            }
            let s = d.model.stats();
            if !crash_mode {
                assert_eq!(s.crashes, injected_crashes);
            }
            assert_eq!(
                s.completed + s.cancelled + s.failed + (s.running + s.waiting) as u64,
                next_index.len() as u64
            );
            assert_eq!(ended.len() + s.running + s.waiting, next_index.len());
        }
    }
}
