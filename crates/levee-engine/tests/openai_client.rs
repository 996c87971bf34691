//! A real client against the engine: the official `openai` Python package completes a
//! streaming and a non-streaming request (tests/openai_client.py).
//!
//! Python comes from `$LEVEE_PYTHON`, else `.venv/bin/python` at the workspace root. Without
//! a Python that can `import openai` the test prints why and passes, unless
//! `LEVEE_REQUIRE_PYTHON=1` (set by CI), where it fails.

// Helpers outside #[test] fns are test code too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_engine::{spawn, EngineConfig};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn python() -> Result<PathBuf, String> {
    let candidate = match std::env::var_os("LEVEE_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"),
    };
    let ok = std::process::Command::new(&candidate)
        .args(["-c", "import openai"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Ok(candidate)
    } else {
        Err(format!(
            "no Python with the openai package at {} (set LEVEE_PYTHON, or run \
             `python3 -m venv .venv && .venv/bin/pip install openai` at the workspace root)",
            candidate.display()
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_works() {
    let python = match python() {
        Ok(p) => p,
        Err(why) => {
            if std::env::var("LEVEE_REQUIRE_PYTHON").as_deref() == Ok("1") {
                panic!("LEVEE_REQUIRE_PYTHON=1 but {why}");
            }
            eprintln!("SKIPPED the_official_openai_python_client_works: {why}");
            return;
        }
    };
    let mut config = EngineConfig::tiny_fast();
    // Real time here (a separate process); run the simulated GPU 20x faster.
    config.time_scale = 20.0;
    let model = config.model.clone();
    let engine = spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let output = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(engine.base_url())
        .arg(&model)
        .env("NO_PROXY", "127.0.0.1")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai_client.py failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let out: Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!(
        "openai {} against levee engine: {out}",
        out["openai_version"]
    );

    assert_eq!(out["models"][0], model.as_str());

    let chat = &out["chat"];
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["completion_tokens"], 6);
    assert_eq!(chat["finish_reason"], "length");
    assert_eq!(
        chat["content"].as_str().unwrap().split_whitespace().count(),
        6
    );
    // The engine's tokenizer: 6 text tokens, 4 per prompt and 5 per message.
    assert_eq!(
        chat["prompt_tokens"],
        levee_engine::tokenizer::count_text("Why do rivers need levees?") + 4 + 5
    );

    let stream = &out["chat_stream"];
    assert_eq!(stream["content_chunks"], 7);
    assert_eq!(stream["completion_tokens"], 7);
    assert_eq!(stream["finish_reason"], "length");
    assert_eq!(
        stream["content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        7
    );

    let completion = out["completion_stream"]["text"].as_str().unwrap();
    assert_eq!(completion.split_whitespace().count(), 5);

    assert_eq!(out["not_found"], "model_not_found");

    let stats = engine.stats();
    assert_eq!((stats.completed, stats.failed), (3, 0));
    engine.shutdown().await.unwrap();
}
