//! Configuration reload on SIGHUP and on file change (an editor's save, a Kubernetes
//! ConfigMap update).
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

/// The name of the link a Kubernetes ConfigMap volume swaps on each update: the mounted
/// `levee.toml` is a link to `..data/levee.toml`, and kubelet writes a new
/// `..<timestamp>/` directory and then atomically renames a new `..data` link over the old
/// one. The file's own name sees no event then; `..data` does.
const CONFIGMAP_DATA_LINK: &str = "..data";

/// What a watcher event must concern to trigger a reload: the config file's name in its
/// directory, the name it resolves to (a link to a file elsewhere), or the ConfigMap link.
#[derive(Debug, Clone)]
struct Watched {
    names: Vec<std::ffi::OsString>,
}

impl Watched {
    fn for_path(path: &Path) -> Watched {
        let mut names = vec![std::ffi::OsString::from(CONFIGMAP_DATA_LINK)];
        let resolved = std::fs::canonicalize(path).ok();
        for p in [Some(path.to_path_buf()), resolved].into_iter().flatten() {
            if let Some(n) = p.file_name() {
                if !names.iter().any(|x| x == n) {
                    names.push(n.to_os_string());
                }
            }
        }
        Watched { names }
    }

    /// Whether `ev` may have changed what the config path reads.
    fn concerns(&self, ev: &notify::Event) -> bool {
        let kind = matches!(
            ev.kind,
            notify::EventKind::Create(_) | notify::EventKind::Modify(_)
        );
        kind && ev.paths.iter().any(|p| {
            p.file_name()
                .is_some_and(|n| self.names.iter().any(|w| w == n))
        })
    }
}

/// The directories to watch for `path`: its own (where a ConfigMap's `..data` link and
/// an editor's rename happen) and, when it is a link to a file elsewhere, that file's.
fn watched_dirs(path: &Path) -> Vec<PathBuf> {
    let parent = |p: &Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut dirs = vec![parent(path)];
    if let Ok(resolved) = std::fs::canonicalize(path) {
        let d = parent(&resolved);
        let same = std::fs::canonicalize(&dirs[0]).is_ok_and(|first| first == d);
        if !same {
            dirs.push(d);
        }
    }
    dirs
}

/// Starts the SIGHUP handler and the file watcher for `path`. The watcher follows the
/// directory, not the file: editors replace a file by rename, and a Kubernetes ConfigMap
/// update replaces the directory the file's link points into.
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
    let watched = Watched::for_path(&path);
    let file_tx = tx.clone();
    let mut watcher =
        notify::recommended_watcher(move |ev: notify::Result<notify::Event>| match ev {
            Ok(ev) => {
                if watched.concerns(&ev) {
                    let _ = file_tx.try_send("file change");
                }
            }
            Err(e) => tracing::warn!("config file watcher error: {e}"),
        })?;
    for dir in watched_dirs(&path) {
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    }
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
            // Off the event loop: reading the file and building the new state (a tokenizer
            // file, say) would otherwise hold up the connections this loop serves.
            let (gw, path) = (gw.clone(), path.clone());
            let reloaded = tokio::task::spawn_blocking(move || reload_from_file(&gw, &path, why));
            if let Err(e) = reloaded.await {
                tracing::error!("configuration reload failed: {e}");
            }
        }
    });
    Ok(())
}
