//! The floor under levee's cost per request, for bench/gateway-overhead.sh and
//! bench/gateway-instructions.sh: a reverse proxy made of nothing but the HTTP stack levee is
//! built on — hyper's HTTP/1.1 server and its pooled keep-alive client on tokio's
//! work-stealing runtime, one worker per core, as `levee serve` runs by default — that passes
//! every request to one upstream and streams the answer back. No authentication, limits,
//! queue, metrics or logging, and HTTP/1.1 only (levee also accepts h2c on the port): the
//! cost of the stack alone, a floor for levee on that runtime. It allocates with the system
//! allocator where levee uses jemalloc, and uses hyper-util's pooled client where levee keeps
//! its own pool.
//!
//! ```text
//! bare_proxy --listen 127.0.0.1:8081 --upstream http://127.0.0.1:8000
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark tool: fail loudly

use http::uri::{PathAndQuery, Uri};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::net::SocketAddr;
use tokio::net::TcpListener;

type Upstream = Client<HttpConnector, Incoming>;

fn main() {
    let mut listen: Option<SocketAddr> = None;
    let mut upstream: Option<Uri> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().expect("every option takes a value");
        match a.as_str() {
            "--listen" => {
                listen = Some(
                    v.parse()
                        .expect("--listen: an address such as 127.0.0.1:8081"),
                )
            }
            "--upstream" => {
                upstream = Some(
                    v.parse()
                        .expect("--upstream: a URL such as http://127.0.0.1:8000"),
                )
            }
            other => panic!("unknown option {other}: give --listen ADDR --upstream URL"),
        }
    }
    let (listen, upstream) = (
        listen.expect("--listen is required"),
        upstream.expect("--upstream is required"),
    );
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(serve(listen, upstream));
}

async fn serve(listen: SocketAddr, upstream: Uri) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
    let listener = TcpListener::bind(listen).await.expect("bind --listen");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| forward(client.clone(), upstream.clone(), req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The request sent on to the upstream as it came (its path and query on the upstream's
/// scheme and authority), the upstream's answer streamed back.
async fn forward(
    client: Upstream,
    upstream: Uri,
    mut req: Request<Incoming>,
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
    let mut parts = upstream.into_parts();
    parts.path_and_query = req
        .uri()
        .path_and_query()
        .cloned()
        .or(Some(PathAndQuery::from_static("/")));
    *req.uri_mut() = Uri::from_parts(parts).expect("the upstream URL with the request's path");
    client.request(req).await
}
