//! The metrics and probe endpoints: `/metrics` (OpenMetrics text), `/healthz`, `/readyz`.

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

/// The content type of `/metrics`: prometheus-client's text encoder writes the OpenMetrics 1.0
/// text format (`_total` counters, `# EOF` last), not the classic Prometheus 0.0.4 text.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

async fn metrics(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    match crate::metrics::encode(&registry) {
        Ok(text) => (StatusCode::OK, [("content-type", METRICS_CONTENT_TYPE)], text),
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

#[cfg(test)]
mod tests {
    use axum::response::IntoResponse;
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics_text() {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("replicator_example", "An example", counter.clone());
        counter.inc();
        let response = metrics(State(Arc::new(registry))).await.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers().get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(text.contains("replicator_example_total 1\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
