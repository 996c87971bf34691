//! Preemption inside a tier (`queue.preempt_over_share`): a tenant over its fair share fills
//! every slot with requests whose answers have not started; a quiet tenant of the same tier
//! then gets a slot at once, the flooder's youngest request is cut short (its upstream
//! request aborted) and queued again, and every request is still answered. In-process
//! gateway and a mock backend that holds its answers until the test releases them; waits
//! poll state and are bounded, no timing is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenant_takes_the_slot_of_the_flooders_youngest_request_which_is_served_later() {
    let be = mock().await;
    let mut cfg = config(std::slice::from_ref(&be.url()), 4);
    cfg.queue.preempt_over_share = true;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();

    // A measured service time first (a share is judged against it): four requests held
    // about a second.
    be.hold(true);
    let warm: Vec<_> = (0..4)
        .map(|i| spawn_chat(&c, &base, "a", &format!("warm-{i}")))
        .collect();
    wait_until("the four warm-up requests at the backend", || {
        be.state.in_flight.load(Ordering::SeqCst) == 4
    })
    .await;
    // Real time must pass for a service time to exist; nothing waits on this sleep.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    be.release(4);
    for h in warm {
        assert_eq!(h.await.unwrap().status(), 200);
    }

    // The flood: far over its share of the four slots, which it fills; the rest queue.
    let flood: Vec<_> = (0..400)
        .map(|i| spawn_chat(&c, &base, "a", &format!("flood-{i}")))
        .collect();
    wait_until("the flood holding every slot", || {
        be.state.in_flight.load(Ordering::SeqCst) == 4
    })
    .await;
    let before = be.count();

    // A quiet tenant of the same tier: it reaches the backend while the flood's answers are
    // still held, in the slot of a flood request cut short.
    let quiet = spawn_chat(&c, &base, "b", "quiet");
    wait_until("the quiet request at the backend", || {
        be.received().iter().any(|v| tag_of(v) == "quiet")
    })
    .await;
    assert!(be.count() > before);
    wait_until("the cut request's upstream aborted", || {
        be.state.cancelled.load(Ordering::SeqCst) >= 1
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

    // Everything is answered once released: served, or refused at once by levee for the
    // flood's predicted wait; a request cut short reached the backend twice and was served
    // the second time.
    be.release(10_000);
    assert_eq!(quiet.await.unwrap().status(), 200);
    let mut served = std::collections::HashSet::new();
    for (i, h) in flood.into_iter().enumerate() {
        let r = h.await.unwrap();
        match r.status().as_u16() {
            200 => {
                served.insert(format!("flood-{i}"));
            }
            429 => assert_eq!(error_json(r).await["error"]["code"], "capacity_overload"),
            s => panic!("flood-{i}: {s} {:?}", r.text().await),
        }
    }
    let mut seen = std::collections::HashMap::<String, usize>::new();
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
