//! Preemption inside a tier (`queue.preempt_over_share`): a tenant over its fair share fills
//! every slot with requests whose answers have not started; a quiet tenant of the same tier
//! then gets a slot at once, the flooder's youngest request is cut short (its upstream
//! request dropped) and queued again, and every request is still answered. In-process
//! gateway and a mock backend that holds its answers until the test releases them; waits
//! poll state and are bounded, no timing is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Sends a chat completion as `who` from a task of its own; its status and whole body.
fn send(
    c: &reqwest::Client,
    base: &str,
    who: &str,
    tag: String,
    stream: bool,
) -> tokio::task::JoinHandle<(u16, String)> {
    let (c, url, key) = (
        c.clone(),
        format!("{base}/v1/chat/completions"),
        format!("key-{who}"),
    );
    tokio::spawn(async move {
        let mut body = chat_body(&tag);
        body["stream"] = Value::Bool(stream);
        let r = c
            .post(url)
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    })
}

/// Tenant `a` floods one backend of four slots with requests the backend holds (streamed
/// ones with their head sent and their first event held, with `stream`); tenant `b` then
/// sends one. Checks that `b` reaches the backend while the flood is held (the held
/// requests cannot end: one was cut short), and that once released everything is answered —
/// the request cut short served on its second send. (When the mock notices a dropped
/// connection is hyper's business; nothing here waits for it.) With `llamacpp`, the backend
/// is a llama-server, which levee sends a stream even for a non-streamed request.
async fn quiet_beside_a_held_flood(stream: bool, llamacpp: bool) {
    let be = mock().await;
    let streamed_upstream = stream || llamacpp;
    be.state
        .head_first
        .store(streamed_upstream, Ordering::SeqCst);
    let mut cfg = config(std::slice::from_ref(&be.url()), 4);
    cfg.queue.preempt_over_share = true;
    if llamacpp {
        cfg.models[0].backends[0].kind = levee_gateway::config::BackendKind::Llamacpp;
    }
    // Queued requests wait for the test's release, however slow the machine: no queue
    // budget may run out first.
    let standard = cfg.tiers.get_mut("standard").unwrap();
    (standard.queue_wait_ms, standard.soft_queue_wait_ms) = (120_000, 120_000);
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();

    // A measured service time first (a share is judged against it): four requests held
    // about a second. Real time must pass for one to exist; nothing waits on this sleep.
    be.hold(true);
    let warm: Vec<_> = (0..4)
        .map(|i| send(&c, &base, "a", format!("warm-{i}"), stream))
        .collect();
    wait_until("the four warm-up requests at the backend", || {
        be.count() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    be.release(4);
    for h in warm {
        assert_eq!(h.await.unwrap().0, 200);
    }

    // The flood: far over its share of the four slots, which it fills; the rest queue.
    let flood: Vec<_> = (0..400)
        .map(|i| send(&c, &base, "a", format!("flood-{i}"), stream))
        .collect();
    wait_until("the flood holding every slot", || be.count() == 8).await;
    if streamed_upstream {
        // Their heads sent: from here only levee's holding them back keeps them preemptible.
        wait_until("the flood's heads sent", || {
            be.state.heads.load(Ordering::SeqCst) == 8
        })
        .await;
    }

    // A quiet tenant of the same tier: it reaches the backend while the flood's answers are
    // still held, in the slot of a flood request cut short.
    let quiet = send(&c, &base, "b", "quiet".into(), stream);
    wait_until("the quiet request at the backend", || {
        be.received().iter().any(|v| tag_of(v) == "quiet")
    })
    .await;
    let m = metrics_text(&gw).await;
    let preempted: f64 = m
        .lines()
        .find(|l| l.starts_with("levee_preempted_total{model=\"m\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("levee_preempted_total for model m");
    assert!(preempted >= 1.0, "{m}");

    // Everything is answered once released: served whole, or refused at once by levee for
    // the flood's predicted wait.
    be.release(10_000);
    let whole = |body: &str| !stream || body.trim_end().ends_with("data: [DONE]");
    let (status, body) = quiet.await.unwrap();
    assert!(status == 200 && whole(&body), "quiet: {status} {body}");
    let mut served = HashSet::new();
    for (i, h) in flood.into_iter().enumerate() {
        let (status, body) = h.await.unwrap();
        match status {
            200 => {
                assert!(whole(&body), "flood-{i}: {body}");
                served.insert(format!("flood-{i}"));
            }
            429 => assert!(body.contains("capacity_overload"), "flood-{i}: {body}"),
            s => panic!("flood-{i}: {s} {body}"),
        }
    }
    let mut seen = HashMap::<String, usize>::new();
    for v in be.received() {
        *seen.entry(tag_of(&v)).or_default() += 1;
    }
    let twice: Vec<_> = seen
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(t, _)| t)
        .collect();
    assert!(!twice.is_empty(), "no request was sent twice");
    for t in twice {
        assert!(served.contains(t), "{t} was cut short and never served");
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenant_takes_the_slot_of_the_flooders_youngest_request_which_is_served_later() {
    quiet_beside_a_held_flood(false, false).await;
}

/// A non-streamed request that levee reads from a llama-server as a stream stays
/// preemptible after the stream's head came, until its answer is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_llamacpp_answer_read_whole_is_cut_short_after_its_streams_head() {
    quiet_beside_a_held_flood(false, true).await;
}

/// A stream whose backend sent its head but not yet its first event has sent nothing to its
/// client: levee holds the head back while it may still be cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_cut_short_until_its_first_event() {
    quiet_beside_a_held_flood(true, false).await;
}
