//! Session affinity through the gateway: a conversation's next turn goes back to the
//! backend that served it, named by a header or recognised by its opening messages; with
//! affinity off the same turn goes by load. In-process gateway and mock backends on
//! ephemeral ports; waits poll state, no timing is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use serde_json::{json, Value};

/// Which of two backends serves a session's second turn, when its first turn found backend
/// 0 busy (so went to 1) and both are idle again: with `header` the turns send
/// `x-session-id`, else the conversation's opening names the session.
async fn second_turn_goes_to(affinity: bool, header: bool) -> usize {
    let (a, b) = (mock().await, mock().await);
    let mut cfg = config(&[a.url(), b.url()], 4);
    cfg.affinity.enabled = affinity;
    cfg.affinity.epsilon = 1.0;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let base = gw.public_url();
    // Hold a request on backend 0 (idle backends tie: the first one takes it).
    a.hold(true);
    let held = spawn_chat(&c, &base, "a", "busy");
    wait_until("the held request reaches backend 0", || a.count() == 1).await;
    let turn = |body: Value| {
        let mut r = c
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("key-s")
            .json(&body);
        if header {
            r = r.header("x-session-id", "conversation-1");
        }
        r.send()
    };
    let opening = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"}
    ]);
    let r = turn(json!({"model": "m", "max_tokens": 4, "messages": opening}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(b.count(), 1, "the first turn goes to the idle backend 1");
    a.hold(false);
    a.release(1);
    assert_eq!(held.await.unwrap().status(), 200);
    wait_until("backend 0 is idle", || {
        a.state.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 0
    })
    .await;
    let mut second = opening.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": "hi"}));
    second.push(json!({"role": "user", "content": "and then?"}));
    let r = turn(json!({"model": "m", "max_tokens": 4, "messages": second}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let served = if b.count() == 2 { 1 } else { 0 };
    assert_eq!(a.count() + b.count(), 3);
    gw.shutdown().await;
    served
}

#[tokio::test]
async fn a_named_session_returns_to_its_backend() {
    assert_eq!(second_turn_goes_to(true, true).await, 1);
}

#[tokio::test]
async fn a_conversation_is_recognised_by_its_opening() {
    assert_eq!(second_turn_goes_to(true, false).await, 1);
}

#[tokio::test]
async fn without_affinity_the_turn_goes_by_load() {
    assert_eq!(second_turn_goes_to(false, true).await, 0);
}
