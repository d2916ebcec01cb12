//! Clusters: kubeconfigs, one client per cluster, and hub health.
//!
//! The hub kubeconfig is required, but while its file is missing or empty the process waits and
//! reports not-ready instead of crash-looping (seed 000: the Secret mount may lag the pod, DESIGN
//! §5). [`HubHealth`] tracks whether the hub answers, so writers pause during an outage instead
//! of spinning, and resume as soon as it is back. The cell and hub clients count every request
//! they send in `replicator_api_requests_total{cluster,verb,resource}` ([`crate::metrics::api_requests`]).

use std::{path::Path, sync::Arc, time::Duration};

use kube::{
    Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Errors building a client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kubeconfig file is missing or empty (the hub's is waited for).
    #[error("kubeconfig {0} is missing or empty")]
    Missing(String),
    /// The kubeconfig could not be read or parsed.
    #[error("failed to load kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// In-cluster configuration is unavailable (no cell kubeconfig was given).
    #[error("no --cell-kubeconfig given and in-cluster config unavailable: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built from the configuration.
    #[error("failed to build client: {0}")]
    Client(#[source] kube::Error),
}

/// Which cluster a client talks to: the `cluster` label of `replicator_api_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The cell whose objects are mirrored.
    Cell,
    /// The Karmada hub.
    Hub,
}

impl Role {
    /// The metric label value: `cell` or `hub`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Cell => "cell",
            Self::Hub => "hub",
        }
    }
}

/// A client from `config` whose every request is counted in
/// `replicator_api_requests_total{cluster=<role>,verb,resource}` as it is sent, and timed in
/// `replicator_api_request_duration_seconds{cluster,verb}` until its response headers arrive.
///
/// # Errors
/// [`Error::Client`] when no client can be built from the configuration.
pub fn counted_client(config: Config, role: Role) -> Result<Client, Error> {
    let layer = tower::layer::layer_fn(move |inner| Counted { inner, role });
    Ok(ClientBuilder::try_from(config)
        .map_err(Error::Client)?
        .with_layer(&layer)
        .build())
}

/// The service of [`counted_client`]'s layer.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    role: Role,
}

impl<S, B> tower::Service<http::Request<B>> for Counted<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let verb = crate::metrics::api_verb(request.method(), request.uri());
        let cluster = self.role.label();
        crate::metrics::api_requests()
            .get_or_create(&crate::metrics::ApiRequestLabels {
                cluster,
                verb,
                resource: crate::metrics::api_resource(request.uri()),
            })
            .inc();
        let sent = std::time::Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            crate::metrics::api_request_duration()
                .get_or_create(&crate::metrics::ApiLatencyLabels { cluster, verb })
                .observe(sent.elapsed().as_secs_f64());
            response
        })
    }
}

async fn config_from_kubeconfig(path: &Path) -> Result<Config, Error> {
    let display = path.display().to_string();
    match tokio::fs::metadata(path).await {
        Ok(m) if m.len() > 0 => {}
        _ => return Err(Error::Missing(display)),
    }
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::Kubeconfig {
        path: display.clone(),
        source,
    })?;
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| Error::Kubeconfig { path: display, source })
}

/// Builds a client from the kubeconfig at `path` (current context); its requests are counted as
/// the hub's.
///
/// # Errors
/// [`Error::Missing`] when the file is absent or empty, [`Error::Kubeconfig`] when it does not
/// parse, [`Error::Client`] when no client can be built from it.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, Error> {
    counted_client(config_from_kubeconfig(path).await?, Role::Hub)
}

/// The cell client: from `path` when given, else the in-cluster service account. Its requests
/// are counted as the cell's.
///
/// # Errors
/// As [`client_from_kubeconfig`], or [`Error::InCluster`].
pub async fn cell_client(path: Option<&Path>) -> Result<Client, Error> {
    let config = match path {
        Some(path) => config_from_kubeconfig(path).await?,
        None => Config::incluster().map_err(Error::InCluster)?,
    };
    counted_client(config, Role::Cell)
}

/// Waits until the hub kubeconfig at `path` yields a client, retrying every `every`.
///
/// Every failed attempt is logged once per distinct message and shown by readiness as the `hub`
/// problem of `health`. Returns `None` if `cancel` fires first.
pub async fn wait_for_hub_client(
    path: &Path,
    every: Duration,
    cancel: &CancellationToken,
    health: &crate::health::Health,
) -> Option<Client> {
    let mut last = String::new();
    loop {
        match client_from_kubeconfig(path).await {
            Ok(client) => return Some(client),
            Err(err) => {
                let msg = err.to_string();
                health.set("hub", msg.clone());
                if msg != last {
                    tracing::warn!(cluster = "hub", error = %msg, "waiting for the hub kubeconfig");
                    last = msg;
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// Whether the hub answers. Writers wait on it; a connection failure flips it down and a prober
/// flips it up again once `/version` answers.
#[derive(Clone)]
pub struct HubHealth {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for HubHealth {
    fn default() -> Self {
        Self::new()
    }
}

impl HubHealth {
    /// Starts as up: the first write tells otherwise.
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(true)),
        }
    }

    /// Whether the hub is currently believed up.
    pub fn is_up(&self) -> bool {
        *self.tx.borrow()
    }

    /// Records that the hub did not answer.
    pub fn mark_down(&self) {
        self.tx.send_if_modified(|up| std::mem::replace(up, false));
    }

    /// Records that the hub answered.
    pub fn mark_up(&self) {
        self.tx.send_if_modified(|up| !std::mem::replace(up, true));
    }

    /// Resolves once the hub is up (immediately if it is).
    pub async fn wait_up(&self) {
        let mut rx = self.tx.subscribe();
        // An error means the sender is gone, which cannot happen while `self` holds it.
        let _ = rx.wait_for(|up| *up).await;
    }

    /// A receiver of up/down changes.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// While down, probes the hub's `/version` every `every` and marks it up when it answers.
    /// Runs until `cancel` fires; `on_change` sees every transition (for the metric and logs).
    pub async fn probe(&self, hub: Client, every: Duration, cancel: CancellationToken, on_change: impl Fn(bool)) {
        let mut rx = self.tx.subscribe();
        on_change(self.is_up());
        loop {
            if self.is_up() {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
                if !self.is_up() {
                    tracing::warn!(
                        cluster = "hub",
                        "hub unreachable; pausing writes and keeping the latest state per key"
                    );
                    on_change(false);
                }
                continue;
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            if hub.apiserver_version().await.is_ok() {
                self.mark_up();
                tracing::info!(cluster = "hub", "hub reachable again; resuming writes");
                on_change(true);
            }
        }
    }
}

/// The retry delays of every watch (cells, hub copies, namespaces, the Lease): 500 ms doubling
/// to 5 s, jittered, back to 500 ms after 60 s without an error.
///
/// kube's default (client-go's 800 ms to 30 s, reset after 120 s) is kind to a struggling
/// apiserver but let a watch sit out up to 30 s after its apiserver returned: measured 23-28 s
/// from a restarted cell apiserver answering to the relists completing. At 5 s the retry load on a
/// down apiserver stays about one request per second per cell (six watches), and a returning one
/// is seen within seconds.
pub fn watch_backoff() -> impl kube::runtime::utils::Backoff {
    let builder = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times();
    kube::runtime::utils::ResetTimerBackoff::new(
        kube::runtime::watcher::ExponentialBackoff::from(builder),
        Duration::from_secs(60),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_or_empty_kubeconfig_is_reported_as_missing() {
        let dir = std::env::temp_dir().join(format!("replicator-kc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("absent");
        assert!(matches!(client_from_kubeconfig(&missing).await, Err(Error::Missing(_))));
        let empty = dir.join("empty");
        std::fs::write(&empty, "").unwrap();
        assert!(matches!(client_from_kubeconfig(&empty).await, Err(Error::Missing(_))));
        let garbage = dir.join("garbage");
        std::fs::write(&garbage, "{not: [yaml").unwrap();
        let result = client_from_kubeconfig(&garbage).await;
        assert!(matches!(result, Err(Error::Kubeconfig { .. })), "{:?}", result.err());
    }

    #[tokio::test]
    async fn a_counted_client_counts_each_request_by_cluster_and_verb() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A one-shot HTTP server answering /version, so the request goes through the real stack.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = socket.read(&mut buf).await.unwrap();
            let body = r#"{"major":"1","minor":"35","gitVersion":"v1.35.4","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":""}"#;
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(response.as_bytes()).await.unwrap();
        });
        let labels = crate::metrics::ApiRequestLabels {
            cluster: "cell",
            verb: "get",
            resource: String::new(),
        };
        let before = crate::metrics::api_requests().get_or_create(&labels).get();
        let client = counted_client(Config::new(url.parse().unwrap()), Role::Cell).unwrap();
        client.apiserver_version().await.unwrap();
        assert_eq!(crate::metrics::api_requests().get_or_create(&labels).get(), before + 1);
        // And timed: the response arrived, so the histogram of cell GETs has a sample.
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("d", "", crate::metrics::api_request_duration().clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let count = text
            .lines()
            .find(|l| l.starts_with("d_count{") && l.contains(r#"cluster="cell""#) && l.contains(r#"verb="get""#))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok());
        assert!(count.is_some_and(|n| n >= 1), "{text}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn hub_health_transitions_and_wait_up() {
        let h = HubHealth::new();
        assert!(h.is_up());
        h.mark_down();
        assert!(!h.is_up());
        let waiter = {
            let h = h.clone();
            tokio::spawn(async move { h.wait_up().await })
        };
        h.mark_up();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
    }
}
