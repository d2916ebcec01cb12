//! The metrics and probe endpoints: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

use std::{net::SocketAddr, sync::Arc};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::health::Health;

/// Flags of the metrics and probe servers, shared by every subcommand that runs a controller.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address serving /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_bind_address: SocketAddr,
    /// Address serving /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub health_probe_bind_address: SocketAddr,
}

/// Starts the metrics and probe servers; each task ends when `cancel` fires or it fails.
pub fn spawn(
    args: &ServeArgs,
    registry: Arc<Registry>,
    health: Health,
    cancel: &CancellationToken,
) -> tokio::task::JoinSet<Result<(), Error>> {
    let mut servers = tokio::task::JoinSet::new();
    servers.spawn(serve_metrics(args.metrics_bind_address, registry, cancel.clone()));
    servers.spawn(serve_probes(args.health_probe_bind_address, health, cancel.clone()));
    servers
}

/// Errors serving HTTP.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address could not be bound.
    #[error("failed to bind {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The server failed while running.
    #[error("http server failed: {0}")]
    Serve(#[source] std::io::Error),
}

async fn metrics(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    match crate::metrics::encode(&registry) {
        Ok(text) => (
            StatusCode::OK,
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            text,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain")],
            "encoding failed".to_owned(),
        ),
    }
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    if health.is_ready() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready:\n{}\n", health.problems().join("\n")),
        )
    }
}

/// Binds `addr` and serves `/metrics` from `registry` until `cancel` fires.
///
/// # Errors
/// [`Error::Bind`] when the address is taken, [`Error::Serve`] on a server failure.
pub async fn serve_metrics(addr: SocketAddr, registry: Arc<Registry>, cancel: CancellationToken) -> Result<(), Error> {
    let app = Router::new().route("/metrics", get(metrics)).with_state(registry);
    serve(addr, app, cancel).await
}

/// Binds `addr` and serves `/healthz` (always 200 while the process runs) and `/readyz`.
///
/// # Errors
/// As [`serve_metrics`].
pub async fn serve_probes(addr: SocketAddr, health: Health, cancel: CancellationToken) -> Result<(), Error> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(health);
    serve(addr, app, cancel).await
}

async fn serve(addr: SocketAddr, app: Router, cancel: CancellationToken) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
        .map_err(Error::Serve)
}
