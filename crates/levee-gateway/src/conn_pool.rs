//! A backend's own keep-alive HTTP/1 connections for proxied requests. The shared client's
//! pool hashes the backend's scheme and authority twice a request and spawns a task per
//! answer to learn when its connection is free again; here each backend keeps a stack of
//! idle connections, and a request gives its connection back itself once it has read the
//! answer whole. Newest first, so a light load keeps few connections warm and the rest
//! reach their idle limit and close.
//!
//! A request that finds no idle connection dials one, but takes a connection given back
//! before its dial is done (the dial goes on by itself and leaves its connection idle), and
//! at most [`MAX_DIALS`] dials are under way to one backend at a time (a request beyond
//! waits for a dial or a connection given back, whichever comes first). Without these, a
//! pause of a few hundred milliseconds at 5,000 requests a second made as many requests
//! dial at once, each waiting for its own dial: past the backend's listen backlog (128 for
//! a listener bound by tokio's `TcpListener::bind`), whose dropped SYNs the kernel retries
//! only after a second, so a short pause became a stall of one to two seconds.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

/// What dials a backend: TCP, with TLS for `https://`.
pub type Connector = HttpsConnector<HttpConnector>;

/// A connection's sending half.
type Sender = SendRequest<Full<Bytes>>;

/// One event loop's idle connections, each with when it was given back, oldest first; on
/// cache lines of its own (128 bytes: adjacent-line prefetchers fetch pairs), so that two
/// loops taking and giving back connections never contend for one line.
#[derive(Default)]
#[repr(align(128))]
struct Idle {
    senders: Mutex<Vec<(Sender, Instant)>>,
    /// Told of each connection given back, for a request waiting for one.
    given_back: Notify,
}

/// An error of dialling a backend, with its causes.
pub(crate) type ConnectError = Box<dyn std::error::Error + Send + Sync>;

/// How long an idle connection is kept: below the 5 s after which llama-server
/// (cpp-httplib) and uvicorn (vLLM) close an idle keep-alive connection, so a request is
/// seldom sent on a connection the server has just closed (it is sent again when it is).
const IDLE_LIMIT: Duration = Duration::from_secs(4);

/// Idle connections kept at most per backend and event loop.
const MAX_IDLE: usize = 4096;

/// Dials under way to one backend at most (see the module's note): a quarter of a
/// 128-connection listen backlog, and still thousands of new connections a second at a
/// round trip of a few milliseconds per dial.
const MAX_DIALS: usize = 32;

/// The longest a dial may take, TLS handshake included. The connector bounds the TCP
/// connect alone (2 s); without this, a backend that accepts and never completes TLS would
/// hold a dial slot for good once its request had taken another connection, and
/// [`MAX_DIALS`] such dials would leave the backend undialable.
const DIAL_LIMIT: Duration = Duration::from_secs(5);

thread_local! {
    /// The event loop this thread runs (`levee serve --event-loops`): 0 unless [`set_event_loop`]
    /// said otherwise.
    static EVENT_LOOP: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks this thread as event loop `n`: the connections it dials are kept for its
/// own requests.
pub(crate) fn set_event_loop(n: usize) {
    EVENT_LOOP.with(|w| w.set(n));
}

/// Idle stacks a pool keeps at most: one per core up to this many (event loops beyond the
/// core count share them, in turn).
const MAX_SHARDS: usize = 64;

/// One backend's idle connections, oldest first, one stack per event loop: a connection's task
/// runs on the event loop that dialled it, and a request of another loop using it would
/// wake that loop's thread twice (to send, to answer). Threads of a work-stealing runtime
/// are all loop 0.
pub(crate) struct ConnPool {
    shards: Box<[Idle]>,
    /// A permit per dial under way.
    dials: Arc<Semaphore>,
}

impl Default for ConnPool {
    fn default() -> Self {
        ConnPool::with_shards(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl ConnPool {
    fn with_shards(n: usize) -> ConnPool {
        ConnPool {
            shards: (0..n.clamp(1, MAX_SHARDS))
                .map(|_| Idle::default())
                .collect(),
            dials: Arc::new(Semaphore::new(MAX_DIALS)),
        }
    }
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("idle", &self.idle())
            .finish()
    }
}

impl ConnPool {
    /// An idle connection to `uri`'s backend that is still open, else whichever comes
    /// first: a connection given back, or a new one dialled with `connector` (once one of
    /// the backend's [`MAX_DIALS`] dials is free).
    pub(crate) async fn checkout(
        self: &Arc<Self>,
        connector: &Connector,
        uri: &http::Uri,
    ) -> Result<Lease, ConnectError> {
        self.checkout_with(|| dial(connector.clone(), uri.clone()))
            .await
    }

    /// [`ConnPool::checkout`] with `dial` making a new connection. A dial races the
    /// connections given back meanwhile: one given back first is taken, and the dial goes on
    /// by itself and leaves its connection idle (a SYN the backend's full backlog dropped is
    /// retried by the kernel only after a second, and must not hold a request that long).
    async fn checkout_with<D, F>(self: &Arc<Self>, dial: D) -> Result<Lease, ConnectError>
    where
        D: Fn() -> F,
        F: std::future::Future<Output = Result<Sender, ConnectError>> + Send + 'static,
    {
        loop {
            if let Some(sender) = self.ready_idle().await {
                return Ok(self.lease(sender));
            }
            let shard = self.shard();
            // Registered before looking again, so a connection given back in between is
            // not missed.
            let given_back = shard.given_back.notified();
            tokio::pin!(given_back);
            given_back.as_mut().enable();
            if !shard.senders.lock().is_empty() {
                continue;
            }
            let permit = match self.dials.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => tokio::select! {
                    biased;
                    () = &mut given_back => continue,
                    p = self.dials.clone().acquire_owned() => p.map_err(|e| Box::new(e) as ConnectError)?,
                },
            };
            let mut dialling = Box::pin(dial());
            loop {
                tokio::select! {
                    biased;
                    sender = &mut dialling => return Ok(self.lease(sender?)),
                    () = &mut given_back => {}
                }
                // A wake may be stale (one given back before anyone waited): look.
                given_back.set(shard.given_back.notified());
                given_back.as_mut().enable();
                if let Some(sender) = self.ready_idle().await {
                    let pool = self.clone();
                    tokio::spawn(async move {
                        if let Ok(sender) = dialling.await {
                            pool.give_back(sender);
                        }
                        drop(permit);
                    });
                    return Ok(self.lease(sender));
                }
            }
        }
    }

    /// The newest idle connection that is still open, once ready to send.
    async fn ready_idle(&self) -> Option<Sender> {
        while let Some(mut sender) = self.take_idle(Instant::now()) {
            // Given back once its answer was read whole: ready as soon as its connection's
            // task has seen that end; an error means the server closed it meanwhile.
            if sender.is_ready() || sender.ready().await.is_ok() {
                return Some(sender);
            }
        }
        None
    }

    fn lease(self: &Arc<Self>, sender: Sender) -> Lease {
        Lease {
            sender,
            pool: self.clone(),
        }
    }

    /// The newest idle connection still open, dropping those idle past [`IDLE_LIMIT`].
    fn take_idle(&self, now: Instant) -> Option<Sender> {
        let mut idle = self.shard().senders.lock();
        let expired = idle.partition_point(|(_, since)| now.duration_since(*since) > IDLE_LIMIT);
        idle.drain(..expired);
        while let Some((sender, _)) = idle.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    }

    fn give_back(&self, sender: Sender) {
        let shard = self.shard();
        let mut idle = shard.senders.lock();
        if idle.len() < MAX_IDLE && !sender.is_closed() {
            idle.push((sender, Instant::now()));
            drop(idle);
            shard.given_back.notify_one();
        }
    }

    /// This thread's event loop's idle connections.
    fn shard(&self) -> &Idle {
        &self.shards[EVENT_LOOP.with(|w| w.get()) % self.shards.len()]
    }

    /// Idle connections kept now.
    fn idle(&self) -> usize {
        self.shards.iter().map(|s| s.senders.lock().len()).sum()
    }
}

/// A new connection to `uri`'s backend, its task spawned; at most [`DIAL_LIMIT`] in the
/// making.
async fn dial(connector: Connector, uri: http::Uri) -> Result<Sender, ConnectError> {
    let connect = async {
        let io = tower::ServiceExt::oneshot(connector, uri).await?;
        Ok::<_, ConnectError>(hyper::client::conn::http1::handshake(io).await?)
    };
    let (sender, conn) = tokio::time::timeout(DIAL_LIMIT, connect)
        .await
        .map_err(|_| {
            format!(
                "the backend took more than {} s to connect and complete its TLS handshake",
                DIAL_LIMIT.as_secs()
            )
        })??;
    tokio::spawn(async move {
        // Ends when the backend closes it, or once idle with its sender dropped.
        if let Err(e) = conn.await {
            tracing::debug!("upstream connection ended: {e}");
        }
    });
    Ok(sender)
}

/// A connection held for one exchange. Given back ([`Lease::give_back`]) once the answer
/// was read whole; dropped otherwise, which closes the connection (a half-read answer
/// leaves it unusable, and dropping it is how a departed client cancels the engine's work).
pub(crate) struct Lease {
    sender: Sender,
    pool: Arc<ConnPool>,
}

/// A request that could not be sent, with whether it went out at all.
pub(crate) struct SendError {
    pub error: hyper::Error,
    /// It never left: the connection had closed first (another connection may take it).
    pub unsent: bool,
}

impl Lease {
    /// Sends `req` on the connection and waits for the answer's head.
    pub(crate) async fn send(
        &mut self,
        req: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, SendError> {
        self.sender.try_send_request(req).await.map_err(|mut e| {
            let unsent = e.take_message().is_some();
            SendError {
                error: e.into_error(),
                unsent,
            }
        })
    }

    /// The answer was read whole: the connection serves the next request.
    pub(crate) fn give_back(self) {
        self.pool.give_back(self.sender);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A server on an ephemeral port answering every request `ok`, counting connections.
    async fn server() -> (http::Uri, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
                    });
                    let io = hyper_util::rt::TokioIo::new(tcp);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .await;
                });
            }
        });
        (format!("http://{addr}/x").parse().unwrap(), accepted)
    }

    fn connector() -> Connector {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
            )
            .https_or_http()
            .enable_http1()
            .wrap_connector(http)
    }

    /// One request on `lease`, its answer read whole.
    async fn ask(lease: &mut Lease, uri: &http::Uri) {
        let req = http::Request::get(uri.clone())
            .header(http::header::HOST, "test")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = lease.send(req).await.ok().unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
    }

    async fn exchange(pool: &Arc<ConnPool>, uri: &http::Uri, give_back: bool) {
        let mut lease = pool.checkout(&connector(), uri).await.unwrap();
        ask(&mut lease, uri).await;
        if give_back {
            lease.give_back();
        }
    }

    #[tokio::test]
    async fn a_connection_given_back_serves_the_next_request_and_a_dropped_one_does_not() {
        let (uri, accepted) = server().await;
        let pool = Arc::new(ConnPool::default());
        for _ in 0..5 {
            exchange(&pool, &uri, true).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle(), 1);
        // Not given back (a half-read answer, a departed client): the next request dials.
        exchange(&pool, &uri, false).await;
        exchange(&pool, &uri, true).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_event_loop_reuses_only_the_connections_it_dialled() {
        let (uri, accepted) = server().await;
        let pool = Arc::new(ConnPool::with_shards(2));
        set_event_loop(1);
        exchange(&pool, &uri, true).await;
        set_event_loop(0);
        exchange(&pool, &uri, true).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "loop 0 dials its own");
        for w in [1, 0, 1] {
            set_event_loop(w);
            exchange(&pool, &uri, true).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "each reuses its own");
        assert_eq!(pool.idle(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_past_the_limit_are_not_reused() {
        let (uri, accepted) = server().await;
        let pool = Arc::new(ConnPool::default());
        exchange(&pool, &uri, true).await;
        tokio::time::advance(IDLE_LIMIT + Duration::from_millis(1)).await;
        exchange(&pool, &uri, true).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(pool.idle(), 1);
    }

    /// A dial that waits for `gate` (counting dials started in `started`) before dialling
    /// `uri`.
    fn gated_dial(
        uri: &http::Uri,
        gate: &Arc<tokio::sync::Semaphore>,
        started: &Arc<AtomicUsize>,
    ) -> impl Fn() -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Sender, ConnectError>> + Send>,
    > {
        let (uri, gate, started) = (uri.clone(), gate.clone(), started.clone());
        move || {
            let (uri, gate, started) = (uri.clone(), gate.clone(), started.clone());
            Box::pin(async move {
                started.fetch_add(1, Ordering::SeqCst);
                let _open = gate.acquire().await.unwrap();
                dial(connector(), uri).await
            })
        }
    }

    /// Lets every task spawned on this single-threaded runtime run until it waits.
    async fn let_tasks_run() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    /// A backend that accepts TCP and never answers a TLS handshake: its dial ends at
    /// [`DIAL_LIMIT`] with an error that says so, and its slot is free again (a dial left to
    /// finish in the background would otherwise hold it for good).
    #[tokio::test(start_paused = true)]
    async fn a_dial_that_never_completes_tls_ends_at_the_limit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((tcp, _)) = listener.accept().await {
                held.push(tcp);
            }
        });
        let uri: http::Uri = format!("https://{addr}/x").parse().unwrap();
        let pool = Arc::new(ConnPool::default());
        let began = Instant::now();
        let err = tokio::time::timeout(DIAL_LIMIT * 4, pool.checkout(&connector(), &uri))
            .await
            .expect("the dial ended by itself")
            .err()
            .expect("a dial that never completes TLS fails");
        assert!(err.to_string().contains("TLS handshake"), "{err}");
        assert!(began.elapsed() >= DIAL_LIMIT, "{:?}", began.elapsed());
        assert_eq!(pool.dials.available_permits(), MAX_DIALS);
    }

    #[tokio::test]
    async fn no_more_than_max_dials_are_under_way_at_once() {
        let (uri, accepted) = server().await;
        let pool = Arc::new(ConnPool::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let n = MAX_DIALS * 3;
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (pool, dial) = (pool.clone(), gated_dial(&uri, &gate, &started));
            tasks.push(tokio::spawn(async move {
                pool.checkout_with(dial).await.map(|_| ())
            }));
        }
        let_tasks_run().await;
        assert_eq!(started.load(Ordering::SeqCst), MAX_DIALS, "the rest wait");
        // Dials finish one by one; each frees a dial for a waiting request.
        gate.add_permits(n);
        for t in tasks {
            t.await.unwrap().ok().unwrap();
        }
        assert_eq!(started.load(Ordering::SeqCst), n);
        assert_eq!(accepted.load(Ordering::SeqCst), n);
    }

    #[tokio::test]
    async fn a_request_whose_dial_hangs_takes_a_connection_given_back_and_the_dial_goes_on() {
        let (uri, accepted) = server().await;
        let pool = Arc::new(ConnPool::default());
        let mut held = pool.checkout(&connector(), &uri).await.ok().unwrap();
        // The next request's dial hangs (a dropped SYN, say).
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let waiting = {
            let (pool, dial, uri) = (pool.clone(), gated_dial(&uri, &gate, &started), uri.clone());
            tokio::spawn(async move {
                let mut lease = pool.checkout_with(dial).await.ok().unwrap();
                ask(&mut lease, &uri).await;
            })
        };
        let_tasks_run().await;
        assert_eq!(started.load(Ordering::SeqCst), 1);
        assert!(!waiting.is_finished());
        ask(&mut held, &uri).await;
        held.give_back();
        // Bounded: a wake lost would otherwise hang the test.
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the waiting request took the connection given back")
            .unwrap();
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "its dial has not connected"
        );
        // The dial, let through, connects by itself and its connection waits idle.
        gate.add_permits(1);
        tokio::time::timeout(Duration::from_secs(10), async {
            while pool.idle() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the dial's connection was kept");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}
