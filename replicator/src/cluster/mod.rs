//! Clusters: kubeconfigs, one client per cluster, and hub health.
//!
//! The hub kubeconfig is required, but while its file is missing or empty the process waits and
//! reports not-ready instead of crash-looping (seed 000: the Secret mount may lag the
//! pod). A kubeconfig that loads but is wrong for the hub (a server nobody listens on, another
//! apiserver whose CA does not match, a token the hub answers 401 to, an account without the role
//! answering 403) keeps the process running and not ready: [`HubHealth`] sums up what the hub
//! requests meet into a [`HubState`], which `/readyz` names (`hub: unreachable at <server>: ...`,
//! `hub: credentials rejected (401 Unauthorized): ...`, `hub: access forbidden (403 Forbidden):
//! ...`), `replicator_hub_up` shows as 0 (not for a 403: the hub answers) and [`HubHealth::monitor`] logs once per change. Writers
//! pause while the hub does not answer or rejects the credentials, and resume as soon as it is
//! back; nothing is written or deleted meanwhile. A fixed kubeconfig is picked up by a restart
//! ([`crate::kubeconfig_watch`]). The cell and hub clients count every request they send in
//! `replicator_api_requests_total{cluster,verb,resource,code}` ([`crate::metrics::api_requests`]).
//!
//! Token files: a kubeconfig user with `tokenFile:` (and no inline `token:`, which kube prefers)
//! is handed to kube as it is, never resolved into a fixed token here, so kube's own refresh
//! applies: it reads the file when the client is built and again at the first request once
//! 50 s have passed since the last read (a 60 s cache, refreshed 10 s before it runs out); a
//! failed read keeps the last token. A rotated token (a kubelet-projected service-account token,
//! a Secret updated in place) is therefore in use within about a minute, without a restart; until
//! then a revoked old token meets 401s, which [`HubHealth`] reports (not ready, writes paused,
//! the probe retrying every second, and each probe is a request that lets kube re-read the
//! file). The in-cluster cell client reads the pod's token file the same way. kube sends the
//! file's bytes verbatim (client-go trims them), so a token file with a trailing newline would
//! make every request fail: [`token_file_problem`] refuses such a file when the client is built,
//! with a message naming it.

mod hub_health;

use std::{path::Path, time::Duration};

use kube::{
    Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
};
use tokio_util::sync::CancellationToken;

use crate::kubeconfig_watch::Fingerprint;

pub use hub_health::{FORBIDDEN_EXPIRES_AFTER, HubHealth, HubState, error_chain};

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
    /// The token file the kubeconfig's user names (`tokenFile:`) holds no usable token (see
    /// [`token_file_problem`]).
    #[error("kubeconfig {kubeconfig}: token file {path} {problem}")]
    TokenFile {
        /// The kubeconfig.
        kubeconfig: String,
        /// The token file, as kube resolved it (relative to the kubeconfig's directory).
        path: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// What is wrong with the content of a token file (a kubeconfig user's `tokenFile:`), or `None`
/// when it is usable. kube sends the file's bytes verbatim as `Authorization: Bearer <bytes>`
/// (client-go trims them first): whitespace around the token (the newline of
/// `kubectl create token > file`) or any other control character makes every request fail
/// before it is sent, so it is refused with the fix named. Pure: the caller reads the file.
pub fn token_file_problem(content: &[u8]) -> Option<String> {
    let Ok(text) = std::str::from_utf8(content) else {
        return Some("is not UTF-8 text".to_owned());
    };
    if text.trim().is_empty() {
        return Some("is empty".to_owned());
    }
    if text.trim() != text {
        return Some(
            "has whitespace or a newline around the token, which the client would send as part of it; \
             write the token alone (for example `kubectl create token ... | tr -d '\\n' > file`)"
                .to_owned(),
        );
    }
    if text.chars().any(char::is_control) {
        return Some("contains control characters".to_owned());
    }
    None
}

/// Checks the token file `config`'s user names, if it names one that kube will use (no inline
/// token): unreadable files are left to kube's own error when the client is built.
fn check_token_file(config: &Config, kubeconfig: &str) -> Result<(), Error> {
    let auth = &config.auth_info;
    let (Some(path), None) = (auth.token_file.as_deref(), auth.token.as_ref()) else {
        return Ok(());
    };
    let Ok(content) = std::fs::read(path) else {
        return Ok(());
    };
    match token_file_problem(&content) {
        None => Ok(()),
        Some(problem) => Err(Error::TokenFile {
            kubeconfig: kubeconfig.to_owned(),
            path: path.to_owned(),
            problem,
        }),
    }
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

/// A client from `config` whose every request is counted once in
/// `replicator_api_requests_total{cluster=<role>,verb,resource,code}`: when its response headers
/// arrive (`code` is the HTTP status; for a watch, when the stream opens), or when it fails or is
/// dropped without them (`code="<error>"`); and timed in
/// `replicator_api_request_duration_seconds{cluster,verb}` until its response headers arrive or
/// it fails.
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

/// Counts one request when dropped: with the code it was given, else as [`NO_RESPONSE`]
/// (a request cancelled before an answer is counted too).
///
/// [`NO_RESPONSE`]: crate::metrics::NO_RESPONSE
struct Tally {
    labels: crate::metrics::ApiRequestLabels,
}

impl Drop for Tally {
    fn drop(&mut self) {
        crate::metrics::api_requests().get_or_create(&self.labels).inc();
    }
}

impl<S, B, RB> tower::Service<http::Request<B>> for Counted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
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
        let mut tally = Tally {
            labels: crate::metrics::ApiRequestLabels {
                cluster,
                verb,
                resource: crate::metrics::api_resource(request.uri()),
                code: crate::metrics::NO_RESPONSE.to_owned(),
            },
        };
        let sent = std::time::Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            tally.labels.code = crate::metrics::api_code(&response);
            drop(tally);
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
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| Error::Kubeconfig {
            path: display.clone(),
            source,
        })?;
    // The config keeps `tokenFile:` as a path: kube reads and refreshes it (module docs).
    check_token_file(&config, &display)?;
    Ok(config)
}

/// Builds a client from the kubeconfig at `path` (current context); its requests are counted as
/// the hub's. A user's `tokenFile:` stays a file kube re-reads (see the module documentation).
///
/// # Errors
/// [`Error::Missing`] when the file is absent or empty, [`Error::Kubeconfig`] when it does not
/// parse, [`Error::TokenFile`] when the token file it names holds no usable token,
/// [`Error::Client`] when no client can be built from it (an unreadable token file included).
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, Error> {
    counted_client(config_from_kubeconfig(path).await?, Role::Hub)
}

/// The hub client, and what it was built from.
#[derive(Clone)]
pub struct Hub {
    /// The client (requests counted as the hub's).
    pub client: Client,
    /// The server URL of the kubeconfig's current context, as messages name it.
    pub server: String,
    /// The content of the kubeconfig file, read before the client was built from it: a file that
    /// changes afterwards differs from it (see [`crate::kubeconfig_watch`]).
    pub kubeconfig: Fingerprint,
}

/// Builds the hub client from the kubeconfig at `path`, with the server it talks to and the
/// fingerprint of the file.
///
/// # Errors
/// As [`client_from_kubeconfig`].
pub async fn hub_from_kubeconfig(path: &Path) -> Result<Hub, Error> {
    // The content is read first: if the file changes between this read and the parse, the
    // watch sees content other than this and restarts the process, never the reverse.
    let kubeconfig = crate::kubeconfig_watch::read(path)
        .await
        .ok_or_else(|| Error::Missing(path.display().to_string()))?;
    let config = config_from_kubeconfig(path).await?;
    let server = config.cluster_url.to_string();
    Ok(Hub {
        client: counted_client(config, Role::Hub)?,
        server: server.trim_end_matches('/').to_owned(),
        kubeconfig,
    })
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
/// Every failed attempt is logged once per distinct message and shown by readiness as the
/// problem of component `key` (`hub`, or `hub <locations>` in a process with several hub
/// kubeconfigs) of `health`. Returns `None` if `cancel` fires first.
pub async fn wait_for_hub_client(
    path: &Path,
    every: Duration,
    cancel: &CancellationToken,
    health: &crate::health::Health,
    key: &str,
) -> Option<Hub> {
    let mut last = String::new();
    loop {
        match hub_from_kubeconfig(path).await {
            Ok(hub) => return Some(hub),
            Err(err) => {
                let msg = err.to_string();
                health.set(key, msg.clone());
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

    #[test]
    fn a_token_file_holds_the_token_alone() {
        assert_eq!(token_file_problem(b"eyJhbGciOiJSUzI1NiJ9.e30.c2ln"), None);
        assert_eq!(token_file_problem(b"").as_deref(), Some("is empty"));
        assert_eq!(token_file_problem(b" \n").as_deref(), Some("is empty"));
        for padded in [&b"token\n"[..], b"token\r\n", b" token", b"token\t"] {
            let problem = token_file_problem(padded).unwrap();
            assert!(
                problem.starts_with("has whitespace or a newline around the token"),
                "{problem}"
            );
            assert!(problem.contains("tr -d '\\n'"), "the fix is named: {problem}");
        }
        assert_eq!(
            token_file_problem(b"tok\nen").as_deref(),
            Some("contains control characters")
        );
        assert_eq!(
            token_file_problem(b"tok\x7fen").as_deref(),
            Some("contains control characters")
        );
        assert_eq!(token_file_problem(&[0xff, 0xfe]).as_deref(), Some("is not UTF-8 text"));
    }

    /// A kubeconfig at `dir/name` for `server` whose user is `user` (YAML lines of the user).
    fn kubeconfig_file(dir: &Path, name: &str, server: &str, user: &str) -> std::path::PathBuf {
        let path = dir.join(name);
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n\
             users: [{{name: u, user: {{{user}}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n\
             current-context: c\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Accepts one connection on `listener`, answers `/version` and returns the request's
    /// `authorization` header.
    async fn authorization_of_one_request(listener: &tokio::net::TcpListener) -> Option<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buf = vec![0u8; 4096];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request ended before its headers");
            request.extend_from_slice(&buf[..n]);
        }
        let body = r#"{"major":"1","minor":"35","gitVersion":"v1.35.4","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":""}"#;
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(response.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&request)
            .lines()
            .find_map(|l| l.strip_prefix("authorization: ").map(str::to_owned))
    }

    #[tokio::test]
    async fn a_token_file_stays_a_file_kube_reads_and_a_padded_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("replicator-tokenfile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tokens")).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("http://{}", listener.local_addr().unwrap());
        // Relative to the kubeconfig's directory, as kubectl reads it.
        let path = kubeconfig_file(&dir, "hub.kubeconfig", &server, "tokenFile: tokens/token");
        std::fs::write(dir.join("tokens/token"), "first-token").unwrap();

        // The configuration keeps the file, not its content: kube's refresh applies.
        let config = config_from_kubeconfig(&path).await.unwrap();
        let named = dir.join("tokens/token").display().to_string();
        assert_eq!(config.auth_info.token_file.as_deref(), Some(named.as_str()));
        assert!(config.auth_info.token.is_none(), "the token is not resolved once");

        // The hub client sends the file's token.
        let hub = hub_from_kubeconfig(&path).await.unwrap();
        let (sent, answered) = tokio::join!(authorization_of_one_request(&listener), hub.client.apiserver_version());
        answered.unwrap();
        assert_eq!(sent.as_deref(), Some("Bearer first-token"));

        // A token file written with a trailing newline is refused, naming the file.
        std::fs::write(dir.join("tokens/token"), "first-token\n").unwrap();
        let err = hub_from_kubeconfig(&path).await.err().unwrap();
        assert!(matches!(err, Error::TokenFile { .. }), "{err}");
        let message = err.to_string();
        assert!(message.contains(&named) && message.contains("newline"), "{message}");

        // An inline token wins over the file (kube's precedence), so the file is not judged.
        let inline = kubeconfig_file(
            &dir,
            "inline.kubeconfig",
            &server,
            "token: inline-token, tokenFile: tokens/token",
        );
        assert!(client_from_kubeconfig(&inline).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A server answering one request per connection with each of `statuses` in turn (a
    /// `/version` body), so requests go through the real client stack.
    async fn answering(statuses: &'static [u16]) -> (String, tokio::task::JoinHandle<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            for status in statuses {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 4096];
                let _ = socket.read(&mut buf).await.unwrap();
                let body = if *status == 200 {
                    r#"{"major":"1","minor":"35","gitVersion":"v1.35.4","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":""}"#
                } else {
                    r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"no","reason":"NotFound","code":404}"#
                };
                let response = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                socket.write_all(response.as_bytes()).await.unwrap();
            }
        });
        (url, server)
    }

    fn requests(cluster: &'static str, resource: &str, code: &str) -> u64 {
        crate::metrics::api_requests()
            .get_or_create(&crate::metrics::ApiRequestLabels {
                cluster,
                verb: "get",
                resource: resource.to_owned(),
                code: code.to_owned(),
            })
            .get()
    }

    #[tokio::test]
    async fn a_counted_client_counts_each_request_by_cluster_verb_and_code() {
        let (url, server) = answering(&[200]).await;
        let before = requests("cell", "", "200");
        let client = counted_client(Config::new(url.parse().unwrap()), Role::Cell).unwrap();
        client.apiserver_version().await.unwrap();
        assert_eq!(requests("cell", "", "200"), before + 1);
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
    async fn an_error_status_and_no_answer_are_counted_by_code() {
        // ConfigMaps: no other test requests them, so the counts are this test's own.
        use k8s_openapi::api::core::v1::ConfigMap;
        let count = |code| requests("hub", "configmaps", code);
        let (found, missing, failed) = (count("200"), count("404"), count("<error>"));
        let (url, server) = answering(&[404]).await;
        let client = counted_client(Config::new(url.parse().unwrap()), Role::Hub).unwrap();
        let api = kube::Api::<ConfigMap>::namespaced(client, "ns-1");
        assert!(api.get("absent").await.is_err());
        server.await.unwrap();
        assert_eq!(count("404"), missing + 1);
        // Nothing listens any more: connection refused, no response, code "<error>".
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let client = counted_client(Config::new(url.parse().unwrap()), Role::Hub).unwrap();
        let api = kube::Api::<ConfigMap>::namespaced(client, "ns-1");
        assert!(api.get("absent").await.is_err());
        assert_eq!(count("<error>"), failed + 1);
        assert_eq!(count("200"), found, "each request is counted once, under its code");
        assert_eq!(count("404"), missing + 1);
    }
}
