//! The official `openai` Python client against an in-process gateway.
//!
//! Python comes from `$LEVEE_PYTHON`, else `<workspace>/.venv/bin/python`. Without one the
//! test is skipped with a message, unless `LEVEE_REQUIRE_PYTHON=1` (CI), where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use std::path::PathBuf;

fn python() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LEVEE_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    venv.exists().then_some(venv)
}

fn has_openai(py: &PathBuf) -> bool {
    std::process::Command::new(py)
        .args(["-c", "import openai"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test]
async fn openai_client_gets_rate_limit_error_and_retries_as_told() {
    let required = std::env::var("LEVEE_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    let py = match python() {
        Some(p) if has_openai(&p) => p,
        _ => {
            assert!(
                !required,
                "LEVEE_REQUIRE_PYTHON=1 but no python with `openai` found"
            );
            eprintln!("skipping: no python with the openai package (set LEVEE_PYTHON)");
            return;
        }
    };
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    // One request, then the next allowed 500 ms later: a short, exact Retry-After.
    cfg.ip_guard.requests_per_second = 2.0;
    cfg.ip_guard.burst = 1;
    let gw = start(cfg).await.unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = tokio::process::Command::new(&py)
        .arg(&script)
        .arg(gw.public_url())
        .arg("key-s")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "python client check failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("OK"));
    gw.shutdown().await;
}
