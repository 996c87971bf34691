//! A trivial OpenAI-like endpoint for benchmarking the simulator beside `wrk`: it answers
//! every request with the same small chat completion, as fast as it can.
//!
//! Usage: `trivial_server [ADDR] [WORKER_THREADS]` (default `127.0.0.1:18080`, 1 thread).
//! Prints `listening on ADDR` once bound. Binds loopback only unless told otherwise.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;

const BODY: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":16,"completion_tokens":1,"total_tokens":17}}"#;

async fn answer(
    request: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    // Read the body so the connection stays reusable.
    let _ = request.into_body().collect().await;
    let mut response = Response::new(Full::new(Bytes::from_static(BODY.as_bytes())));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:18080".into());
    let threads: usize = args.next().map(|t| t.parse()).transpose()?.unwrap_or(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
