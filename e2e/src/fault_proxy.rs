//! A TCP fault proxy for drills: it forwards a loopback port to an upstream address (an
//! apiserver; TLS passes through untouched, so the upstream's certificate still verifies for
//! `127.0.0.1`) until a test injects a partition:
//!
//! - [`FaultProxy::cut`]: every open connection is closed and new ones are accepted and closed at
//!   once, as a refused or reset network looks to a client: it notices at once and retries with
//!   its backoff;
//! - [`FaultProxy::blackhole`]: traffic stops silently; open connections and new ones hang, as a
//!   partition that drops packets looks: the client notices nothing until the link comes back;
//! - [`FaultProxy::restore`]: connections held by a partition are closed (they did not survive
//!   it) and new ones pass again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::error::{Result, io_context};

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forwarding.
    Open,
    /// Closing every connection.
    Cut,
    /// Holding every connection without forwarding a byte.
    Blackhole,
}

/// A running proxy; dropping it stops it and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    /// The mode and an epoch bumped on every change: a connection ends when the epoch moves.
    state: Arc<watch::Sender<(Mode, u64)>>,
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
        let state = Arc::new(watch::Sender::new((Mode::Open, 0)));
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

    /// Cuts the link: closes every open connection and closes new ones as they come.
    pub fn cut(&self) {
        self.set(Mode::Cut);
    }

    /// Drops traffic silently: open and new connections hang until [`FaultProxy::restore`].
    pub fn blackhole(&self) {
        self.set(Mode::Blackhole);
    }

    /// Lets connections through again; those a partition held are closed.
    pub fn restore(&self) {
        self.set(Mode::Open);
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.state.borrow().0
    }

    /// Connections accepted so far (forwarded, held or closed).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    fn set(&self, mode: Mode) {
        self.state.send_modify(|(m, epoch)| {
            *m = mode;
            *epoch += 1;
        });
        tracing::info!(addr = %self.addr, ?mode, "fault proxy");
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
    state: Arc<watch::Sender<(Mode, u64)>>,
    accepted: Arc<AtomicU64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let (mode, epoch) = *state.borrow();
        let mut changes = state.subscribe();
        tokio::spawn(async move {
            let mut client = client;
            match mode {
                Mode::Cut => {}
                Mode::Blackhole => {
                    // Held, never answered, until the mode changes; then closed.
                    let _ = changes.wait_for(|(_, e)| *e != epoch).await;
                }
                Mode::Open => {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                        _ = changes.wait_for(|(_, e)| *e != epoch) => {}
                    }
                    let (now, epoch) = *changes.borrow();
                    if now == Mode::Blackhole {
                        // The partition holds the connection silently until it ends.
                        let _ = changes.wait_for(|(_, e)| *e != epoch).await;
                    }
                    drop(server);
                }
            }
            // Dropping the sockets closes the connection.
            drop(client);
        });
    }
}
