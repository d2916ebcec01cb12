//! A TCP fault proxy for drills: it forwards a loopback port to an upstream address (an
//! apiserver; TLS passes through untouched, so the upstream's certificate still verifies for
//! `127.0.0.1`) until a test cuts it. While cut, every open connection is closed and new ones are
//! accepted and closed at once, as a network partition looks to a client; restoring lets
//! connections through again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::error::{Result, io_context};

/// A running proxy; dropping it stops it and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    /// `true` while connections pass; every change of epoch closes the open tunnels.
    state: Arc<watch::Sender<(bool, u64)>>,
    accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:<free port>` and forwards to `upstream`.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> Result<FaultProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(io_context("binding the fault proxy"))?;
        let addr = listener
            .local_addr()
            .map_err(io_context("reading the fault proxy's address"))?;
        let state = Arc::new(watch::Sender::new((true, 0)));
        let accepted = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept_loop(
            listener,
            upstream,
            Arc::clone(&state),
            Arc::clone(&accepted),
        ));
        tracing::info!(%addr, %upstream, "fault proxy started");
        Ok(FaultProxy {
            addr,
            state,
            accepted,
            task,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:<port>`: the proxy as an apiserver URL.
    pub fn https_url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Cuts the link: closes every open connection and refuses (accepts and closes) new ones.
    pub fn cut(&self) {
        self.state.send_modify(|(open, epoch)| {
            *open = false;
            *epoch += 1;
        });
        tracing::info!(addr = %self.addr, "fault proxy cut");
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.state.send_modify(|(open, epoch)| {
            *open = true;
            *epoch += 1;
        });
        tracing::info!(addr = %self.addr, "fault proxy restored");
    }

    /// Whether connections currently pass.
    pub fn is_open(&self) -> bool {
        self.state.borrow().0
    }

    /// Connections accepted so far (passed or refused).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    state: Arc<watch::Sender<(bool, u64)>>,
    accepted: Arc<AtomicU64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let (open, epoch) = *state.borrow();
        if !open {
            drop(client);
            continue;
        }
        let mut changes = state.subscribe();
        tokio::spawn(async move {
            let mut client = client;
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            // Dropping both sockets when the epoch changes is what closes the connection.
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                _ = changes.wait_for(|(_, e)| *e != epoch) => {}
            }
        });
    }
}
