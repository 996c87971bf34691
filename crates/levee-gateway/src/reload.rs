//! Configuration reload on SIGHUP and on file change.
//!
//! A reload parses and validates the new file first; a bad file is refused with a log line
//! naming every error, and the running configuration stays. In-flight and queued requests
//! are untouched either way (see [`crate::gateway::Gateway::reload`]).

use crate::config::Config;
use crate::gateway::Gateway;
use notify::{RecursiveMode, Watcher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Reloads `path` into `gw` once, logging the result. Returns whether the new config is live.
pub fn reload_from_file(gw: &Arc<Gateway>, path: &Path, why: &str) -> bool {
    let result = Config::load(path).and_then(|cfg| gw.reload(cfg));
    match result {
        Ok(()) => {
            tracing::info!(file = %path.display(), trigger = why, "configuration reloaded");
            true
        }
        Err(errs) => {
            tracing::error!(
                file = %path.display(),
                trigger = why,
                "new configuration refused, keeping the old one: {}",
                errs.join("; ")
            );
            false
        }
    }
}

/// Starts the SIGHUP handler and the file watcher for `path`.
pub fn watch(gw: Arc<Gateway>, path: PathBuf) -> anyhow::Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<&'static str>(16);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup())?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                if tx.send("SIGHUP").await.is_err() {
                    break;
                }
            }
        });
    }
    // Editors replace files by rename, so watch the directory and filter on the name.
    let abs = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
    let dir = abs
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let file_name = abs.file_name().map(|n| n.to_os_string());
    let file_tx = tx.clone();
    let mut watcher =
        notify::recommended_watcher(move |ev: notify::Result<notify::Event>| match ev {
            Ok(ev) => {
                let ours = ev
                    .paths
                    .iter()
                    .any(|p| p.file_name().map(|n| n.to_os_string()) == file_name);
                let relevant = matches!(
                    ev.kind,
                    notify::EventKind::Modify(_) | notify::EventKind::Create(_)
                );
                if ours && relevant {
                    let _ = file_tx.try_send("file change");
                }
            }
            Err(e) => tracing::warn!("config file watcher error: {e}"),
        })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    let stop = gw.stopped_token();
    tokio::spawn(async move {
        // Keep the watcher alive as long as this task runs.
        let _watcher = watcher;
        loop {
            let why = tokio::select! {
                _ = stop.cancelled() => break,
                w = rx.recv() => match w { Some(w) => w, None => break },
            };
            // Writes arrive as bursts of events; settle, then read the file once.
            tokio::time::sleep(Duration::from_millis(200)).await;
            while rx.try_recv().is_ok() {}
            reload_from_file(&gw, &path, why);
        }
    });
    Ok(())
}
