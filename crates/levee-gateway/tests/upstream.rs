//! What levee sends to a backend, and how it reaches it: the backend's own API key
//! (`api_key_env`, never the client's key) and static `headers`, the request id and trace
//! context passed on, a custom or absent health path, and an `https://` backend whose
//! certificate chains to a private CA (`ca_file`), made here with rcgen.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::*;
use levee_gateway::config::BackendConfig;
use levee_gateway::start;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Headers of the requests a backend received.
type Seen = Arc<Mutex<Vec<HeaderMap>>>;

fn answer() -> Response {
    axum::Json(serde_json::json!({"id": "x", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
    .into_response()
}

/// A backend that answers only `Authorization: Bearer upstream-secret`, with a health check
/// at `/ready` (and none at `/health`).
fn keyed_backend(seen: Seen) -> axum::Router {
    axum::Router::new()
        .route(
            "/v1/chat/completions",
            post(|State(seen): State<Seen>, headers: HeaderMap| async move {
                seen.lock().push(headers.clone());
                match headers.get("authorization") {
                    Some(v) if v == "Bearer upstream-secret" => answer(),
                    _ => StatusCode::UNAUTHORIZED.into_response(),
                }
            }),
        )
        .route("/ready", get(|| async { "ok" }))
        .with_state(seen)
}

async fn serve_plain(app: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_keyed_backend_gets_its_key_headers_and_the_request_context() {
    std::env::set_var("LEVEE_TEST_UPSTREAM_KEY", "upstream-secret");
    let seen: Seen = Arc::default();
    let url = serve_plain(keyed_backend(seen.clone())).await;
    let mut cfg = config(&[url], 4);
    cfg.scrape.interval_ms = 20;
    let b = &mut cfg.models[0].backends[0];
    b.api_key_env = Some("LEVEE_TEST_UPSTREAM_KEY".into());
    b.headers = BTreeMap::from([("x-org".to_string(), "acme-inference".to_string())]);
    b.health_path = "/ready".into();
    let gw = start(cfg).await.unwrap();
    let c = client();
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .header("x-request-id", "req-42")
        .header("traceparent", trace)
        .header("tracestate", "vendor=1")
        .json(&chat_body("hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let h = seen.lock()[0].clone();
    assert_eq!(
        h["authorization"], "Bearer upstream-secret",
        "not the client's key"
    );
    assert_eq!(h["x-org"], "acme-inference");
    assert_eq!(h["x-request-id"], "req-42");
    assert_eq!(h["traceparent"], trace);
    assert_eq!(h["tracestate"], "vendor=1");
    // The health check at /ready passes: after several scrapes the backend still serves.
    let g = gw.gateway().clone();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let state = g.state_json();
    assert_eq!(state["models"][0]["backends"][0]["healthy"], true);
    // The id levee made up is the one the backend sees when the client sends none.
    let r = chat(&c, &gw.public_url(), "s", "no id").await;
    let id = r.headers()["x-request-id"].clone();
    assert_eq!(seen.lock()[1]["x-request-id"], id);
    assert!(!seen.lock()[1].contains_key("traceparent"));
    gw.shutdown().await;
}

#[tokio::test]
async fn without_its_key_the_backend_refuses_and_a_missing_key_is_a_config_error() {
    let seen: Seen = Arc::default();
    let url = serve_plain(keyed_backend(seen.clone())).await;
    let gw = start(config(std::slice::from_ref(&url), 4)).await.unwrap();
    let r = chat(&client(), &gw.public_url(), "s", "keyless").await;
    assert_eq!(r.status(), 401, "the backend's 401 comes back");
    gw.shutdown().await;
    let mut cfg = config(&[url], 4);
    cfg.models[0].backends[0].api_key_env = Some("LEVEE_TEST_UNSET_UPSTREAM_KEY".into());
    let errs = cfg.validate();
    assert!(
        errs.iter()
            .any(|e| e.contains("backends[0].api_key_env") && e.contains("not set")),
        "{errs:?}"
    );
}

#[tokio::test]
async fn passive_health_only_serves_a_backend_without_a_health_check() {
    // An Ollama-like backend: no /health, no /metrics.
    let seen: Seen = Arc::default();
    std::env::set_var("LEVEE_TEST_PASSIVE_KEY", "upstream-secret");
    let url = serve_plain(keyed_backend(seen)).await;
    let mut cfg = config(&[url], 4);
    cfg.scrape.interval_ms = 20;
    cfg.models[0].backends[0].api_key_env = Some("LEVEE_TEST_PASSIVE_KEY".into());
    cfg.models[0].backends[0].health_path = String::new();
    let gw = start(cfg).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let r = chat(&client(), &gw.public_url(), "s", "passive").await;
    assert_eq!(
        r.status(),
        200,
        "never marked down by a check it cannot pass"
    );
    gw.shutdown().await;
    // With the default /health, the same backend is marked down by its failed checks.
    let seen: Seen = Arc::default();
    let url = serve_plain(keyed_backend(seen)).await;
    let mut cfg = config(&[url], 4);
    cfg.scrape.interval_ms = 20;
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    wait_until("marked unhealthy by /health", || {
        g.state_json()["models"][0]["backends"][0]["healthy"] == false
    })
    .await;
    gw.shutdown().await;
}

/// A CA and a certificate it signed for localhost and 127.0.0.1.
struct TestPki {
    ca_pem: String,
    cert: rustls::pki_types::CertificateDer<'static>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
}

fn test_pki() -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "levee test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        cert: leaf.der().clone(),
        key: rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    }
}

/// Serves `app` over TLS with `pki`'s certificate.
async fn serve_tls(app: axum::Router, pki: &TestPki) -> String {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![pki.cert.clone()], pki.key.clone_key())
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                break;
            };
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    tower::ServiceExt::oneshot(app.clone(), req)
                });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    format!("https://localhost:{port}")
}

#[tokio::test]
async fn an_https_backend_with_a_private_ca() {
    let pki = test_pki();
    let seen: Seen = Arc::default();
    std::env::set_var("LEVEE_TEST_TLS_KEY", "upstream-secret");
    let url = serve_tls(
        keyed_backend(seen.clone()).route("/health", get(|| async { "ok" })),
        &pki,
    )
    .await;
    let dir = std::env::temp_dir().join(format!("levee-upstream-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).unwrap();

    let backend = |ca: Option<std::path::PathBuf>| BackendConfig {
        url: url.clone(),
        api_key_env: Some("LEVEE_TEST_TLS_KEY".into()),
        ca_file: ca,
        ..BackendConfig::default()
    };
    let mut cfg = config(&[], 4);
    cfg.scrape.interval_ms = 20;
    cfg.models[0].backends = vec![backend(Some(ca_file.clone()))];
    let gw = start(cfg).await.unwrap();
    let r = chat(&client(), &gw.public_url(), "s", "over tls").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(seen.lock().len(), 1);
    // The health check goes over TLS too, with the same trust.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        gw.gateway().state_json()["models"][0]["backends"][0]["healthy"],
        true
    );
    gw.shutdown().await;

    // Without the CA, the certificate is not trusted: the request never reaches it.
    let mut cfg = config(&[], 4);
    cfg.models[0].backends = vec![backend(None)];
    let gw = start(cfg).await.unwrap();
    let r = chat(&client(), &gw.public_url(), "s", "untrusted").await;
    assert!(r.status().is_server_error(), "{}", r.status());
    assert_eq!(seen.lock().len(), 1, "nothing reached the backend");
    gw.shutdown().await;

    // A ca_file that is not a certificate is a config error naming the field.
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let mut cfg = config(&[], 4);
    cfg.models[0].backends = vec![backend(Some(junk))];
    let errs = cfg.validate();
    assert!(
        errs.iter().any(|e| e.contains("backends[0].ca_file")),
        "{errs:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Peers a backend saw, by address: one per connection.
type Peers = Arc<Mutex<std::collections::HashSet<std::net::SocketAddr>>>;

#[tokio::test]
async fn answers_read_whole_leave_their_upstream_connection_for_the_next_request() {
    use axum::extract::ConnectInfo;
    let peers: Peers = Arc::default();
    let app =
        axum::Router::new()
            .route(
                "/v1/chat/completions",
                post(
                    |State(p): State<Peers>,
                     ConnectInfo(from): ConnectInfo<std::net::SocketAddr>| async move {
                        p.lock().insert(from);
                        answer()
                    },
                ),
            )
            .route("/health", get(|| async { "ok" }))
            .with_state(peers.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
        let _ = axum::serve(l, app).await;
    });
    let gw = start(config(&[format!("http://{addr}")], 4)).await.unwrap();
    let c = client();
    for i in 0..5 {
        let r = chat(&c, &gw.public_url(), "s", &format!("turn {i}")).await;
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    assert_eq!(
        peers.lock().len(),
        1,
        "five answers in turn came on one upstream connection"
    );
    gw.shutdown().await;
}

/// The test configuration with the mock `m` as a llama-server of `cap` slots.
fn llamacpp_config(m: &Mock, cap: u32) -> levee_gateway::Config {
    let mut cfg = config(&[m.url()], cap);
    cfg.models[0].backends[0].kind = levee_gateway::config::BackendKind::Llamacpp;
    cfg
}

/// A llama-server notices a non-streamed client gone only when it has nothing else to do,
/// so levee asks it for a stream and answers the client whole: the client gets the body
/// the engine would have sent unstreamed, and the engine's work stops when the client
/// leaves even once the stream has started.
#[tokio::test]
async fn a_llamacpp_backend_streams_what_levee_answers_whole() {
    use std::sync::atomic::Ordering;
    let m = mock().await;
    let gw = start(llamacpp_config(&m, 4)).await.unwrap();
    let c = client();
    let r = chat(&c, &gw.public_url(), "s", "whole").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let v: serde_json::Value = r.json().await.unwrap();
    let sent = &m.received()[0];
    assert_eq!(sent["stream"], true, "{sent}");
    assert_eq!(sent["stream_options"]["include_usage"], true, "{sent}");
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant", "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], " w0 w1 w2 w3", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");

    // The head and nothing more: the client leaves; the upstream stream is dropped.
    m.state.head_first.store(true, Ordering::SeqCst);
    m.hold(true);
    let held = spawn_chat(&c, &gw.public_url(), "s", "left");
    wait_until("the stream's head sent", || {
        m.state.heads.load(Ordering::SeqCst) == 1
    })
    .await;
    held.abort();
    wait_until("the engine's work dropped", || {
        m.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    gw.shutdown().await;
}

/// A stream read whole still shows levee the engine's first token: non-streamed answers
/// from a llama-server teach the backend's time to first token, and a tier whose objective
/// the backend cannot meet refuses a predicted miss.
#[tokio::test]
async fn a_llamacpp_backends_whole_answers_teach_its_time_to_first_token() {
    use levee_gateway::config::SloMiss;
    let m = mock().await;
    *m.state.first_token_delay.lock() = Duration::from_millis(60);
    let mut cfg = llamacpp_config(&m, 8);
    let premium = cfg.tiers.get_mut("premium").unwrap();
    premium.ttft_slo_ms = Some(30);
    premium.slo_miss = SloMiss::Refuse;
    let gw = start(cfg).await.unwrap();
    let c = client();
    // The free tier has no objective: all of these go, none of them streamed.
    for i in 0..20 {
        let r = chat(&c, &gw.public_url(), "f", &format!("learn {i}")).await;
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let r = chat(&c, &gw.public_url(), "p", "premium").await;
    assert_eq!(r.status(), 429, "{}", r.text().await.unwrap());
    assert_eq!(r.headers()["x-levee-refusal"], "predicted_slo_miss");
    gw.shutdown().await;
}
