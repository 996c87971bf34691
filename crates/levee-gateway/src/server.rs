//! Listeners, connection handling, graceful shutdown and the in-process handle.
//!
//! Connections are served by hyper directly (not `axum::serve`) because the gateway must cut
//! off slow or huge header blocks (`header_read_timeout`, `max_buf_size`) and must know each
//! peer's IP for the per-IP guard. HTTP/1.1 and h2c (prior knowledge) are both accepted.
//! Each listener caps its open connections (in all and per IP, [`crate::conn`]), and each
//! connection is watched: closed when it brings no request in time, idles, or has served
//! its request budget.

use crate::config::Config;
use crate::conn::{self, Activity, ConnLimits, ConnSlot, IdlePolicy, TrackedBody};
use crate::gateway::Gateway;
use crate::metrics::{ListenerLabel, ReasonLabel};
use crate::request_log::{RequestId, REQUEST_ID_HEADER};
use crate::tasks::Tasks;
use crate::{admin, routes};
use axum::extract::ConnectInfo;
use futures::future::Either;
use futures::FutureExt;
use hyper::body::Incoming;
use hyper::server::conn::http1::Builder as Http1Builder;
use hyper::server::conn::http2::Builder as Http2Builder;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::Service;

/// Concurrent streams per HTTP/2 connection.
const H2_MAX_STREAMS: u32 = 16_384;

/// A running gateway started in-process (tests, the drill) or by `levee serve`.
pub struct GatewayHandle {
    public: SocketAddr,
    admin: SocketAddr,
    gateway: Arc<Gateway>,
    /// Async tasks, when `tasks.enabled`.
    async_tasks: Option<Arc<Tasks>>,
    stop_accepting: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl GatewayHandle {
    /// Address of the public (OpenAI-compatible) listener.
    pub fn public_addr(&self) -> SocketAddr {
        self.public
    }

    /// Address of the admin listener.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// `http://<public addr>`.
    pub fn public_url(&self) -> String {
        format!("http://{}", self.public)
    }

    /// `http://<admin addr>`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// The shared gateway state (admin operations, reload).
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// Replaces the configuration without dropping in-flight or queued requests. A config
    /// that fails validation is refused and the old one kept; the errors are returned.
    pub fn reload(&self, cfg: Config) -> Result<(), Vec<String>> {
        self.gateway.reload(cfg)
    }

    /// Graceful shutdown: stop accepting, answer queued requests with 503 + Retry-After,
    /// let in-flight requests finish within `server.shutdown_grace_ms`, then return.
    pub async fn shutdown(self) {
        let grace = Duration::from_millis(self.gateway.config().server.shutdown_grace_ms);
        self.gateway.drain();
        self.gateway.flush_queues();
        self.stop_accepting.cancel();
        let all = futures::future::join_all(self.tasks);
        if tokio::time::timeout(grace + Duration::from_millis(500), all)
            .await
            .is_err()
        {
            tracing::warn!("shutdown grace period passed with connections still open");
        }
        self.gateway.leave_fleet().await;
        if let Some(t) = &self.async_tasks {
            // The tasks this replica holds go back to the fleet's queue.
            t.leave().await;
        }
        self.gateway.stop();
    }
}

/// Binds both listeners from `config.listen` (port 0 allowed) and starts serving, all on the
/// current runtime.
pub async fn start(config: Config) -> anyhow::Result<GatewayHandle> {
    start_with(config, 1).await
}

/// [`start`], with the public listener served by `loops` event loops: this runtime's and
/// one single-threaded runtime on a thread of its own for each of the others (`levee serve
/// --event-loops`).
async fn start_with(config: Config, loops: usize) -> anyhow::Result<GatewayHandle> {
    let errors = config.validate();
    if !errors.is_empty() {
        anyhow::bail!("invalid configuration:\n  {}", errors.join("\n  "));
    }
    let public_listener = bind(config.listen.public)
        .map_err(|e| anyhow::anyhow!("cannot bind public {}: {e}", config.listen.public))?;
    let admin_listener = bind(config.listen.admin)
        .map_err(|e| anyhow::anyhow!("cannot bind admin {}: {e}", config.listen.admin))?;
    let public = public_listener.local_addr()?;
    let admin = admin_listener.local_addr()?;
    let gateway = Gateway::new(config)?;
    crate::upkeep::spawn(&gateway);
    let async_tasks = open_tasks(&gateway)?;
    if let Some(t) = &async_tasks {
        t.clone().start(&gateway).await?;
    }
    let stop_accepting = CancellationToken::new();
    let public_router = routes::router(gateway.clone(), async_tasks.clone());
    let access = admin::AdminAccess::from_env(admin);
    access.announce(&gateway);
    let admin_router = admin::router(gateway.clone(), access);
    let public_l = Listening::public(public_listener, public_router, &gateway);
    let admin_l = Listening::admin(admin_listener, admin_router, &gateway);
    let mut tasks = spawn_loops(&public_l, &gateway, &stop_accepting, loops)?;
    tasks.extend([
        tokio::spawn(accept_loop(
            public_l,
            gateway.clone(),
            stop_accepting.clone(),
        )),
        tokio::spawn(accept_loop(
            admin_l,
            gateway.clone(),
            stop_accepting.clone(),
        )),
    ]);
    tracing::info!(%public, %admin, "levee gateway listening");
    Ok(GatewayHandle {
        public,
        admin,
        gateway,
        async_tasks,
        stop_accepting,
        tasks,
    })
}

/// The public listener's other event loops (loop 1 onwards, `loops - 1` of them): each a
/// single-threaded runtime on a thread of its own, accepting on the same socket (the kernel
/// wakes each; the first to accept takes the connection) and serving its connections to
/// their end, with its own upstream connections ([`crate::conn_pool`]). A connection's
/// request, its backend exchange and their wake-ups then stay on one thread, as in a
/// worker process of nginx, where a work-stealing runtime hands them between threads; but
/// no other thread takes them up while the kernel puts that thread off (BENCHMARKS.md,
/// "Gateway overhead": the tail latency of a busy machine). Returns, for each, a task of
/// the current runtime that ends when its loop has.
fn spawn_loops(
    public: &Listening,
    gw: &Arc<Gateway>,
    stop: &CancellationToken,
    loops: usize,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    use std::os::fd::AsFd;
    let mut done = Vec::new();
    for n in 1..loops {
        let tcp = public.tcp.as_fd().try_clone_to_owned().map_err(|e| {
            anyhow::anyhow!("cannot share the public listener with event loop {n}: {e}")
        })?;
        let tcp = std::net::TcpListener::from(tcp);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| anyhow::anyhow!("cannot start event loop {n}'s runtime: {e}"))?;
        let (router, limits) = (public.router.clone(), public.limits.clone());
        let (gw, stop) = (gw.clone(), stop.clone());
        let (ended, end) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("levee-loop-{n}"))
            .spawn(move || {
                crate::conn_pool::set_event_loop(n);
                runtime.block_on(async move {
                    match TcpListener::from_std(tcp) {
                        Ok(tcp) => {
                            let l = Listening {
                                name: "public",
                                tcp,
                                router,
                                limits,
                            };
                            accept_loop(l, gw, stop).await;
                        }
                        Err(e) => tracing::error!(event_loop = n, "cannot listen: {e}"),
                    }
                });
                // Its connections' tasks end with the runtime, before the loop is reported
                // done.
                drop(runtime);
                let _ = ended.send(());
            })
            .map_err(|e| anyhow::anyhow!("cannot start event loop {n}'s thread: {e}"))?;
        done.push(tokio::spawn(async move {
            let _ = end.await;
        }));
    }
    Ok(done)
}

/// The async task service, when `tasks.enabled`: on this replica's own store, or on the
/// fleet's shared queue with `[state] backend = "redis"`.
fn open_tasks(gw: &Gateway) -> anyhow::Result<Option<Arc<Tasks>>> {
    let cfg = gw.config();
    if !cfg.tasks.enabled {
        return Ok(None);
    }
    let tasks = match gw.shared() {
        None => Tasks::open(&cfg.tasks)?,
        Some(s) => Tasks::open_shared(&cfg.tasks, &cfg.state, s.redacted_url(), s.replica())?,
    };
    Ok(Some(Arc::new(tasks)))
}

/// The HTTP/2 connection preface a prior-knowledge h2c client starts with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the client opens with the HTTP/2 preface (h2c, prior knowledge). Reads nothing:
/// the bytes stay in the socket for hyper. A client that has sent only part of the preface
/// is polled again shortly (the caller bounds the whole wait).
async fn sniff_h2(stream: &tokio::net::TcpStream) -> std::io::Result<bool> {
    let mut buf = [0u8; 24];
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed before sending a request",
            ));
        }
        let n = n.min(H2_PREFACE.len());
        if buf[..n] != H2_PREFACE[..n] {
            return Ok(false);
        }
        if n == H2_PREFACE.len() {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Listen backlog. A burst of new connections (clients reconnecting after a stall) must
/// queue in the kernel rather than have SYNs dropped, which costs clients 1 s+ retransmits.
/// The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 8192;

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_nodelay(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Connections the admin listener holds at once: a flood on the public listener never
/// takes these descriptors, and operators and Prometheus need only a few.
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// One listener: its name (the `listener` label), router and connection caps.
struct Listening {
    name: &'static str,
    tcp: TcpListener,
    router: axum::Router,
    limits: Arc<ConnLimits>,
}

impl Listening {
    fn public(tcp: TcpListener, router: axum::Router, gw: &Gateway) -> Listening {
        let sv = &gw.config().server;
        let max = conn::effective_max(sv.max_connections, conn::open_file_limit());
        tracing::info!(
            max_connections = max,
            per_ip = sv.max_connections_per_ip,
            "public listener caps"
        );
        Listening::with("public", tcp, router, gw, max, sv.max_connections_per_ip)
    }

    fn admin(tcp: TcpListener, router: axum::Router, gw: &Gateway) -> Listening {
        Listening::with("admin", tcp, router, gw, ADMIN_MAX_CONNECTIONS, 0)
    }

    fn with(
        name: &'static str,
        tcp: TcpListener,
        router: axum::Router,
        gw: &Gateway,
        max: usize,
        per_ip: usize,
    ) -> Listening {
        let gauge = gw
            .metrics()
            .open_connections
            .get_or_create(&ListenerLabel {
                listener: name.into(),
            })
            .clone();
        Listening {
            name,
            tcp,
            router,
            limits: ConnLimits::new(max, per_ip, gauge),
        }
    }
}

async fn accept_loop(l: Listening, gateway: Arc<Gateway>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            r = l.tcp.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(listener = l.name, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match l.limits.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                let reason = why.as_str().to_string();
                gateway
                    .metrics()
                    .connections_refused
                    .get_or_create(&ReasonLabel { reason })
                    .inc();
                tracing::debug!(%peer, listener = l.name, "connection refused: {}", why.as_str());
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let server_cfg = gateway.config().server.clone();
        let conn = Conn {
            peer,
            public: l.name == "public",
            _slot: slot,
            stop: stop.clone(),
            gw: gateway.clone(),
        };
        serve_connection(stream, l.router.clone(), &server_cfg, conn);
    }
    drop(l.tcp);
    let grace = Duration::from_millis(gateway.config().server.shutdown_grace_ms);
    if tokio::time::timeout(grace, l.limits.all_closed())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the grace period; closing them");
    }
}

/// What a connection's task holds besides its socket: its place under the caps, the stop
/// signal, the gateway.
struct Conn {
    peer: SocketAddr,
    /// On the public listener (whose requests the pipeline counts).
    public: bool,
    /// Held until the connection's task ends (dropping it frees the place).
    _slot: ConnSlot,
    stop: CancellationToken,
    gw: Arc<Gateway>,
}

/// Serves one accepted connection on a task of its own: HTTP/1 (slow/huge header
/// protection) or h2c with prior knowledge (a proxy in front can multiplex many waiting
/// requests over a few connections). The protocol is sniffed with `peek` and each is served
/// by its own hyper builder rather than hyper-util's auto connection: the task of a
/// connection — alive for as long as its request waits in the queue — then holds only that
/// protocol's state (an auto connection is sized for HTTP/2's, ~1.5 KB against ~0.6 KB for
/// HTTP/1).
fn serve_connection(
    stream: tokio::net::TcpStream,
    router: axum::Router,
    server_cfg: &crate::config::ServerConfig,
    conn: Conn,
) {
    let header_timeout = Duration::from_millis(server_cfg.header_read_timeout_ms);
    let max_header_bytes = server_cfg.max_header_bytes;
    let policy = IdlePolicy {
        first_request: header_timeout,
        idle: Duration::from_millis(server_cfg.idle_timeout_ms),
        max_requests: server_cfg.max_requests_per_connection,
    };
    let activity = Activity::new(policy.max_requests);
    let svc = service(router, &conn, activity.clone());
    tokio::spawn(async move {
        let peer = conn.peer;
        let sniffed = Box::pin(tokio::time::timeout(header_timeout, sniff_h2(&stream))).await;
        let h2 = match sniffed {
            Ok(Ok(h2)) => h2,
            Ok(Err(e)) => {
                tracing::debug!(%peer, "connection ended: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "connection ended: nothing received in time");
                conn.gw.metrics().connections_expired.inc();
                return;
            }
        };
        let io = TokioIo::new(stream);
        // The connection gets a task of its own, spawned from this sniffing task (which
        // then ends): that task holds the connection future and its watch, no builder, no
        // sniffing state.
        if h2 {
            let mut b = Http2Builder::new(TokioExecutor::new());
            b.timer(TokioTimer::new())
                .max_concurrent_streams(H2_MAX_STREAMS)
                .max_header_list_size(u32::try_from(max_header_bytes).unwrap_or(u32::MAX));
            tokio::spawn(watch(
                Box::pin(b.serve_connection(io, svc)),
                activity,
                policy,
                conn,
            ));
        } else {
            let mut b = Http1Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(max_header_bytes.max(HYPER_BUFFER_BYTES))
                .keep_alive(true);
            let served = with_fresh_write_buffer(|| Box::pin(b.serve_connection(io, svc)));
            tokio::spawn(watch(served, activity, policy, conn));
        }
    });
}

/// The size of hyper's HTTP/1 connection buffers (its `INIT_BUFFER_SIZE`): the write buffer
/// a connection allocates when it is built, and the read buffer it allocates on its first
/// read and again after each request whose body is still held when it next reads; also the
/// least `max_buf_size` hyper accepts.
const HYPER_BUFFER_BYTES: usize = 8192;

/// Builds an HTTP/1 connection with `build` so that hyper's write buffer, which a waiting
/// connection never writes, takes memory of its own and not the read buffer a previous
/// connection has just freed. That freed buffer holds the page the previous request was
/// read into; the allocator hands the most recently freed block of a size to the next
/// allocation of that size, which without this is the write buffer, so every waiting
/// connection kept a written page of its own (with 10,000 requests queued: 102 MB against
/// 61 MB with this; BENCHMARKS.md, "Gateway overhead"). Held over the build, the block goes
/// to the connection's first read instead, which writes into it anyway. One more allocation
/// and free a connection, no lasting memory.
fn with_fresh_write_buffer<T>(build: impl FnOnce() -> T) -> T {
    let recycled = std::hint::black_box(Vec::<u8>::with_capacity(HYPER_BUFFER_BYTES));
    let built = build();
    drop(recycled);
    built
}

/// The service of one connection: each request is counted as in progress on it until its
/// response body is sent.
fn service(
    router: axum::Router,
    conn: &Conn,
    activity: Arc<Activity>,
) -> impl hyper::service::Service<
    http::Request<Incoming>,
    Response = http::Response<axum::body::Body>,
    Error = std::convert::Infallible,
    Future = impl std::future::Future<
        Output = Result<http::Response<axum::body::Body>, std::convert::Infallible>,
    > + Send
                 + 'static,
> {
    // The router's own future, not an async block around it (hyper keeps the request's
    // service future for as long as it waits in the queue).
    let (peer, public, gw) = (conn.peer, conn.public, conn.gw.clone());
    hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
        let active = activity.begin();
        let id = RequestId::for_request(req.headers(), Some(peer));
        let echo = id.value.clone();
        let http1 = req.version() < http::Version::HTTP_2;
        let pipeline = routes::pipeline_path(req.uri().path())
            .filter(|_| public && req.method() == http::Method::POST);
        let gw = gw.clone();
        let answer = match pipeline {
            Some(path) => {
                let arrival = crate::pipeline::Arrival::new(&gw, id);
                let served = routes::pipeline_direct(gw.clone(), arrival, req, path);
                Either::Left(Box::pin(served.map(Ok::<_, std::convert::Infallible>)))
            }
            None => {
                req.extensions_mut().insert(ConnectInfo(peer));
                Either::Right(Box::pin(router.clone().call(req)))
            }
        };
        answer.map(move |r| {
            r.map(|resp| {
                let mut resp = resp.map(|b| axum::body::Body::new(TrackedBody::new(b, active)));
                resp.headers_mut().insert(REQUEST_ID_HEADER, echo);
                // A replica on its way out closes kept-alive connections after each answer:
                // the client's next request connects anew, to a ready replica.
                if http1 && gw.is_leaving() {
                    resp.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                }
                resp
            })
        })
    })
}

/// Drives a connection to its end, closing it gracefully (HTTP/2: GOAWAY; HTTP/1: after
/// the answer in progress) when the gateway stops or its activity watch expires. Two
/// phases, open then closing, each waiting on its own events: a connection (alive for as
/// long as its request waits in the queue) holds one phase's waiting state, not both; and
/// the connection comes boxed, held once rather than as an argument and a pinned local.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice while a request waits"
)]
fn watch<C>(
    mut conn: Pin<Box<C>>,
    activity: Arc<Activity>,
    policy: IdlePolicy,
    c: Conn,
) -> impl std::future::Future<Output = ()>
where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    async move {
        let expired = tokio::select! {
            r = conn.as_mut() => return ended(&c, r),
            _ = c.stop.cancelled() => false,
            _ = activity.expired(&policy) => true,
        };
        activity.closing();
        if expired {
            c.gw.metrics().connections_expired.inc();
        }
        conn.as_mut().graceful_shutdown();
        tokio::select! {
            r = conn.as_mut() => ended(&c, r),
            // An HTTP/2 graceful close waits for the client to acknowledge a PING, which a
            // silent client never does: once closing, a connection with no request in
            // progress for the first-request timeout is dropped.
            _ = activity.quiet_for(policy.first_request) => {}
        }
    }
}

/// A connection's end, as hyper reports it.
fn ended<E: std::fmt::Display>(c: &Conn, r: Result<(), E>) {
    if let Err(e) = r {
        tracing::debug!(peer = %c.peer, "connection ended: {e}");
    }
}

/// Runs `levee serve`: load the config, serve, reload on SIGHUP and file change, shut down
/// gracefully on SIGTERM / Ctrl-C.
pub async fn serve_cli(args: crate::ServeArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config).map_err(|errs| {
        anyhow::anyhow!(
            "{}: invalid configuration:\n  {}",
            args.config.display(),
            errs.join("\n  ")
        )
    })?;
    let handle = start_with(cfg, args.event_loops.max(1)).await?;
    if args.event_loops > 0 {
        tracing::info!(
            loops = args.event_loops,
            "public listener on single-threaded event loops"
        );
    }
    let gw = handle.gateway().clone();
    crate::reload::watch(gw.clone(), args.config.clone())?;
    wait_for_termination().await;
    tracing::info!("shutting down: draining queue, letting in-flight requests finish");
    handle.shutdown().await;
    Ok(())
}

#[cfg(unix)]
async fn wait_for_termination() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let ctrl_c = tokio::signal::ctrl_c();
    match term {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = ctrl_c => {}
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_termination() {
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    #[tokio::test]
    async fn sniffs_the_h2_preface_without_consuming_it() {
        let (mut c, s) = pair().await;
        c.write_all(&H2_PREFACE[..10]).await.unwrap();
        let sniff = tokio::spawn(async move { (sniff_h2(&s).await.unwrap(), s) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        c.write_all(&H2_PREFACE[10..]).await.unwrap();
        let (h2, s) = sniff.await.unwrap();
        assert!(h2);
        let mut buf = [0u8; 24];
        assert_eq!(
            s.peek(&mut buf).await.unwrap(),
            24,
            "the preface stays unread"
        );

        let (mut c, s) = pair().await;
        c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\n")
            .await
            .unwrap();
        assert!(!sniff_h2(&s).await.unwrap());

        let (c, s) = pair().await;
        drop(c);
        assert!(sniff_h2(&s).await.is_err());
    }

    #[tokio::test]
    async fn serves_http1_and_h2c() {
        let mut cfg = Config::default();
        cfg.listen.public = "127.0.0.1:0".parse().unwrap();
        cfg.listen.admin = "127.0.0.1:0".parse().unwrap();
        let gw = start(cfg).await.unwrap();
        let url: http::Uri = format!("{}/healthz", gw.public_url()).parse().unwrap();
        for h2 in [false, true] {
            let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .http2_only(h2)
                .build_http::<http_body_util::Empty<bytes::Bytes>>();
            let resp = client.get(url.clone()).await.unwrap();
            assert_eq!(resp.status(), 200, "h2 = {h2}");
            let want = if h2 {
                http::Version::HTTP_2
            } else {
                http::Version::HTTP_11
            };
            assert_eq!(resp.version(), want);
        }
        gw.shutdown().await;
    }

    #[tokio::test]
    async fn a_second_event_loop_serves_the_public_listener_while_the_first_is_busy() {
        let mut cfg = Config::default();
        cfg.listen.public = "127.0.0.1:0".parse().unwrap();
        cfg.listen.admin = "127.0.0.1:0".parse().unwrap();
        let gw = start_with(cfg, 2).await.unwrap();
        let url: http::Uri = format!("{}/healthz", gw.public_url()).parse().unwrap();
        // This test's runtime is the gateway's first loop: blocked until the client, on a
        // runtime of its own, has its answers, so only loop 1 can accept and serve them.
        let client = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                for _ in 0..5 {
                    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                        .build_http::<http_body_util::Empty<bytes::Bytes>>();
                    let resp =
                        tokio::time::timeout(Duration::from_secs(5), client.get(url.clone()))
                            .await
                            .expect("answered in time")
                            .unwrap();
                    assert_eq!(resp.status(), 200);
                }
            })
        });
        client.join().expect("every request served by loop 1");
        // Shutdown returns once loop 1 has ended too.
        tokio::time::timeout(Duration::from_secs(10), gw.shutdown())
            .await
            .expect("shutdown waits for and ends every loop");
    }
}
