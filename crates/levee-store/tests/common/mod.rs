//! The test harness shared by this crate's test files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_store::RedisStore;
use std::time::Duration;

/// The store and the runtime its connection lives on.
pub fn redis_store(tag: &str) -> Option<(tokio::runtime::Runtime, RedisStore)> {
    let prefix = format!(
        "levee-test:{}:{tag}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = {
        let _in = rt.enter();
        RedisStore::new("redis://127.0.0.1:6379", &prefix, Duration::from_secs(2)).ok()?
    };
    let up = rt.block_on(store.heartbeat("probe", Duration::from_secs(1)));
    match up {
        Ok(_) => Some((rt, store)),
        Err(e) => {
            if std::env::var("LEVEE_REQUIRE_REDIS").as_deref() == Ok("1") {
                panic!("LEVEE_REQUIRE_REDIS=1 but Redis on 127.0.0.1:6379 is unreachable: {e}");
            }
            eprintln!(
                "SKIPPED: Redis on 127.0.0.1:6379 is unreachable ({e}); \
                 set LEVEE_REQUIRE_REDIS=1 to fail instead"
            );
            None
        }
    }
}
