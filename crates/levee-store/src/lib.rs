//! levee-store: where the limit state shared by gateway replicas lives.
//!
//! One interface, [`LimitStore`], decides a request against the request-rate and token
//! limits of a few scopes (global, tenant) at once and settles it afterwards (refund of a
//! request never served, reconcile of the token estimate with the real usage). Two stores
//! implement it:
//!
//! * [`MemoryStore`]: levee-policy's own limiters ([`levee_policy::Gcra`],
//!   [`levee_policy::TokenBucket`]) behind a lock, on an injected clock. A gateway uses it
//!   as its local fallback when the shared store cannot answer.
//! * [`RedisStore`]: the same arithmetic as atomic Lua scripts on a Redis (or Valkey)
//!   server, one round trip per decision, the server's `TIME` as the clock, so every replica
//!   of a fleet sees one state.
//!
//! The same property tests run against both (`tests/stores.rs`), and the scripts and
//! levee-policy's limiters decide the same random sequences of times and costs alike, on one
//! manual clock ([`RedisStore::with_clock`], `tests/scripts_agree.rs`).
//! [`RedisStore::heartbeat`] also tells a replica how many replicas are alive.
//!
//! See `docs/replicas.md` for how the gateway uses this crate.

#![warn(missing_docs)]

mod limits;
mod memory;
mod redis_store;

pub use limits::{
    Decision, Figures, LimitStore, Limited, ScopeLimits, Settlement, Slice, SliceDecision,
    StoreError,
};
pub use memory::MemoryStore;
pub use redis_store::{RedisStore, FLEET_VERSION, SCRIPT_VERSION};
