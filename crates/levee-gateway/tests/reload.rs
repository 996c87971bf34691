//! A Kubernetes ConfigMap update reaches the running gateway. kubelet mounts a ConfigMap as
//! `levee.toml -> ..data/levee.toml` with `..data -> ..<timestamp>/`, and on an update
//! writes a new `..<timestamp>/`, renames a fresh `..data` link over the old one (atomic)
//! and removes the old directory: the file's own name sees no event. This test makes the
//! same moves in a temporary directory and waits for the reload.
#![cfg(unix)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use levee_gateway::{reload, start, Config};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("levee-reload-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A config file text: one model over `backend`, admitting `rpm` requests a minute for
/// tenant `t`.
fn config_text(backend: &str, rpm: u32) -> String {
    format!(
        "[listen]\npublic = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
         [scrape]\ninterval_ms = 0\n\
         [[tenants]]\nname = \"t\"\nkey_sha256 = [\"{}\"]\nrequests_per_minute = {rpm}\n\
         [[models]]\nname = \"m\"\n[[models.backends]]\nurl = \"{backend}\"\n",
        levee_gateway::hash_key("key-t")
    )
}

/// Writes `..<stamp>/levee.toml` and points `..data` at it the way kubelet does: a new link
/// renamed over the old one.
fn publish(dir: &Path, stamp: &str, text: &str) {
    let data = dir.join(format!("..{stamp}"));
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("levee.toml"), text).unwrap();
    let tmp = dir.join("..data_tmp");
    symlink(format!("..{stamp}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
}

fn rpm(gw: &levee_gateway::GatewayHandle) -> u32 {
    gw.gateway().config().tenants[0].requests_per_minute
}

#[tokio::test]
async fn a_configmap_update_is_reloaded() {
    let m = mock().await;
    let dir = temp_dir("configmap");
    publish(
        &dir,
        "2026_01_01_00_00_00.000000001",
        &config_text(&m.url(), 100),
    );
    let path = dir.join("levee.toml");
    symlink("..data/levee.toml", &path).unwrap();

    let gw = start(Config::load(&path).unwrap()).await.unwrap();
    assert_eq!(rpm(&gw), 100);
    reload::watch(gw.gateway().clone(), path.clone()).unwrap();

    publish(
        &dir,
        "2026_01_01_00_01_00.000000002",
        &config_text(&m.url(), 200),
    );
    std::fs::remove_dir_all(dir.join("..2026_01_01_00_00_00.000000001")).unwrap();
    wait_until("the ConfigMap update is reloaded", || rpm(&gw) == 200).await;

    // A second update, after the first swap, is followed too.
    publish(
        &dir,
        "2026_01_01_00_02_00.000000003",
        &config_text(&m.url(), 300),
    );
    wait_until("the second update is reloaded", || rpm(&gw) == 300).await;

    // A bad update is refused and the running config kept; the next good one applies.
    publish(
        &dir,
        "2026_01_01_00_03_00.000000004",
        "[[models]]\nname = 3\n",
    );
    publish(
        &dir,
        "2026_01_01_00_04_00.000000005",
        &config_text(&m.url(), 400),
    );
    wait_until("the good update after a bad one", || rpm(&gw) == 400).await;

    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_editor_replacing_the_file_by_rename_is_reloaded() {
    let m = mock().await;
    let dir = temp_dir("editor");
    let path = dir.join("levee.toml");
    std::fs::write(&path, config_text(&m.url(), 100)).unwrap();
    let gw = start(Config::load(&path).unwrap()).await.unwrap();
    reload::watch(gw.gateway().clone(), path.clone()).unwrap();
    let tmp = dir.join(".levee.toml.swp");
    std::fs::write(&tmp, config_text(&m.url(), 150)).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    wait_until("the renamed file is reloaded", || rpm(&gw) == 150).await;
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 22: an emptied or truncated file is refused on reload (the running configuration
/// stays and requests keep being served), as `levee config check` refuses it.
#[tokio::test]
async fn an_empty_or_truncated_file_is_refused_on_reload() {
    let m = mock().await;
    let dir = temp_dir("broken");
    let path = dir.join("levee.toml");
    let full = config_text(&m.url(), 100);
    std::fs::write(&path, &full).unwrap();
    let gw = start(Config::load(&path).unwrap()).await.unwrap();
    let cut = full[..full.find("[[models]]").unwrap()].to_string();
    for (what, text) in [("empty", String::new()), ("cut before [[models]]", cut)] {
        std::fs::write(&path, &text).unwrap();
        assert!(
            !reload::reload_from_file(gw.gateway(), &path, "test"),
            "{what} was accepted"
        );
        assert!(levee_gateway::check_config_file(&path).is_err(), "{what}");
        assert_eq!(rpm(&gw), 100, "{what}: the running configuration stays");
        let r = client()
            .post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth("key-t")
            .json(&serde_json::json!({"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": "still here"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{what}");
    }
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
