//! `levee sim calibrate` against the simulated engine over real sockets: the sweep completes,
//! learns what the engine says about itself, and its fit loads as an engine profile. Only
//! structure is asserted here (the wall clock is noisy); the fit's arithmetic is unit-tested
//! in `calibrate.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

use levee_engine::{spawn, EngineConfig};
use levee_sim::calibrate::{fit, measure, CalibrateArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_against_the_simulated_engine_completes_and_fits_a_loadable_profile() {
    let mut known = EngineConfig::tiny_fast();
    known.model = "known".into();
    known.time_scale = 10.0;
    let engine = spawn(known.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let args = CalibrateArgs {
        target: engine.base_url(),
        model: None,
        levels: vec![1, 2],
        level_secs: 0.5,
        max_requests_per_level: 20,
        rounds: 2,
        prompt_tokens: 64,
        output_tokens: 8,
        prefill_lengths: vec![16, 256],
        prefill_repeats: 2,
        seed: 3,
        out: None,
        name: "fitted".into(),
        sweep_json: None,
        compare: None,
        tolerance: 0.2,
        no_prefill: false,
    };
    let sweep = measure(&args).await.unwrap();
    assert_eq!(sweep.model, "known");
    assert_eq!(sweep.levels.len(), 2);
    // Several requests per worker over kept-alive connections, none failed.
    assert!(
        sweep
            .levels
            .iter()
            .all(|l| l.failed == 0 && l.completed >= 2 * l.concurrency),
        "{sweep:?}"
    );
    assert_eq!(sweep.prefill.len(), 2);
    // The repeated prompt is the prefill series' longest.
    assert_eq!(sweep.warm.as_ref().map(|w| w.prompt_tokens), Some(256));
    // The engine describes itself like vLLM: context from /v1/models, KV from the metrics.
    assert_eq!(sweep.server.max_model_len, Some(known.gpu.max_model_len));
    assert_eq!(
        sweep.server.kv_capacity_tokens,
        Some(known.gpu.kv_capacity_tokens)
    );
    let fitted = fit(&sweep, "fitted").unwrap();
    assert_eq!(fitted.model, "known");
    assert_eq!(fitted.gpu.kv_capacity_tokens, known.gpu.kv_capacity_tokens);
    fitted.validate().unwrap();
    assert!((0.0..=1.0).contains(&fitted.gpu.cached_prefill_cost));
    engine.shutdown().await.unwrap();
}
