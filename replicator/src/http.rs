//! The metrics and probe endpoints: `/metrics` (OpenMetrics text, or Prometheus text 0.0.4 when
//! the client asks for it), `/healthz`, `/readyz`.

use std::{net::SocketAddr, sync::Arc};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::IntoResponse,
    routing::get,
};
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

/// The content type of `/metrics` by default: prometheus-client's text encoder writes the
/// OpenMetrics 1.0 text format (`_total` counters, `# EOF` last).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of `/metrics` for a client that prefers the classic text format.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition formats `/metrics` serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text ([`METRICS_CONTENT_TYPE`]).
    OpenMetrics,
    /// Prometheus text 0.0.4 ([`TEXT_CONTENT_TYPE`]).
    Text,
}

/// The format to answer an `Accept` header with: the media range with the highest `q` among
/// `application/openmetrics-text` and `text/plain` (OpenMetrics on a tie, without the header, or
/// when it names neither, as for `*/*`). What Prometheus sends prefers OpenMetrics; a scrape
/// config limited to `PrometheusText0.0.4`, or `curl -H 'Accept: text/plain'`, gets the classic
/// format.
pub fn negotiate(accept: Option<&str>) -> Format {
    let (mut openmetrics, mut text) = (None::<f32>, None::<f32>);
    for range in accept.unwrap_or_default().split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(Some(1.0), |(_, v)| v.trim().parse::<f32>().ok())
            .unwrap_or(0.0);
        let slot = match media.as_str() {
            "application/openmetrics-text" => &mut openmetrics,
            "text/plain" => &mut text,
            _ => continue,
        };
        *slot = Some(slot.map_or(q, |old| old.max(q)));
    }
    match (openmetrics, text) {
        (None, Some(t)) if t > 0.0 => Format::Text,
        (Some(o), Some(t)) if t > o => Format::Text,
        _ => Format::OpenMetrics,
    }
}

async fn metrics(State(registry): State<Arc<Registry>>, headers: HeaderMap) -> impl IntoResponse {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let (encoded, content_type) = match negotiate(accept) {
        Format::OpenMetrics => (crate::metrics::encode(&registry), METRICS_CONTENT_TYPE),
        Format::Text => (crate::metrics::encode_text(&registry), TEXT_CONTENT_TYPE),
    };
    match encoded {
        Ok(text) => (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], text),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
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

    async fn get_metrics(accept: Option<&str>) -> (Option<String>, String) {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("replicator_example", "An example", counter.clone());
        counter.inc();
        let mut headers = HeaderMap::new();
        if let Some(accept) = accept {
            headers.insert(header::ACCEPT, accept.parse().unwrap());
        }
        let response = metrics(State(Arc::new(registry)), headers).await.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (content_type, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics_text_by_default() {
        for accept in [None, Some("*/*")] {
            let (content_type, text) = get_metrics(accept).await;
            assert_eq!(
                content_type.as_deref(),
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
            );
            assert!(text.contains("# HELP replicator_example An example.\n"), "{text}");
            assert!(text.contains("replicator_example_total 1\n"), "{text}");
            assert!(text.ends_with("# EOF\n"), "{text}");
        }
    }

    #[tokio::test]
    async fn metrics_are_served_as_classic_text_when_asked() {
        let (content_type, text) = get_metrics(Some("text/plain;version=0.0.4")).await;
        assert_eq!(
            content_type.as_deref(),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        assert_eq!(
            text,
            "# HELP replicator_example_total An example.\n# TYPE replicator_example_total counter\nreplicator_example_total 1\n"
        );
    }

    #[test]
    fn negotiation_follows_q_values() {
        let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        let cases = [
            (None, Format::OpenMetrics),
            (Some(""), Format::OpenMetrics),
            (Some("*/*"), Format::OpenMetrics),
            (Some(prometheus), Format::OpenMetrics),
            (Some("text/plain;version=0.0.4;q=0.9,*/*;q=0.1"), Format::Text),
            (Some("text/plain"), Format::Text),
            (Some("TEXT/PLAIN; q=1"), Format::Text),
            (Some("text/plain;q=0"), Format::OpenMetrics),
            (
                Some("text/plain;q=0.4, application/openmetrics-text;q=0.5"),
                Format::OpenMetrics,
            ),
            (
                Some("text/plain;q=0.6, application/openmetrics-text;q=0.5"),
                Format::Text,
            ),
            (Some("text/plain, application/openmetrics-text"), Format::OpenMetrics),
            (Some("application/json"), Format::OpenMetrics),
            (Some("text/plain;q=bogus"), Format::OpenMetrics),
        ];
        for (accept, format) in cases {
            assert_eq!(negotiate(accept), format, "{accept:?}");
        }
    }
}
