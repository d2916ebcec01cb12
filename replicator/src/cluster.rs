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

use std::{path::Path, sync::Arc, time::Duration};

use kube::{
    Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::kubeconfig_watch::Fingerprint;

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

/// What is known of the hub, as [`HubHealth::state`] sums up what its requests met.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HubState {
    /// The hub answers and accepts this process's credentials.
    Up,
    /// The hub does not answer: nothing listens, a name that does not resolve, a TLS handshake
    /// failing on a CA that does not match, no answer in time. The text is the cause.
    Unreachable(String),
    /// The hub answers 401: it does not accept the credentials of the hub kubeconfig (a token
    /// of another cluster, a revoked or expired one). The text is the hub's message.
    Unauthorized(String),
    /// The hub answers 403 to a request every replica needs (its copy lists, its Lease, the
    /// watches of `membership`): the account lacks the role. The text is the hub's message,
    /// naming the user and the resource.
    Forbidden(String),
}

impl HubState {
    /// Whether the hub answers and no request meets a 401 or 403.
    pub fn is_up(&self) -> bool {
        matches!(self, Self::Up)
    }

    /// Whether the hub answers and authenticates this process (`replicator_hub_up`): up, or
    /// forbidden a resource. A 403 is a readiness problem and an error metric, not a hub outage:
    /// an apiserver that has just started refuses requests for a moment before its RBAC cache is
    /// filled, and that must not read as the hub being down for the 403's whole expiry.
    pub fn answers(&self) -> bool {
        matches!(self, Self::Up | Self::Forbidden(_))
    }

    /// The `/readyz` problem of the `hub` component when the hub is at `server`; `None` when up.
    pub fn problem(&self, server: &str) -> Option<String> {
        match self {
            Self::Up => None,
            Self::Unreachable(cause) => Some(format!("unreachable at {server}: {cause}")),
            Self::Unauthorized(message) => Some(format!(
                "credentials rejected (401 Unauthorized): {server} does not accept the credentials of the hub kubeconfig ({message})"
            )),
            Self::Forbidden(message) => Some(format!("access forbidden (403 Forbidden): {message}")),
        }
    }

    /// Whether `other` is the same state, whatever its text: a new line is logged only when
    /// this changes.
    fn same_kind(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// How long a 403 reported by one source counts without being reported again. Every source
/// retries within 5 s (the watch backoff, the election's), so a lasting 403 is refreshed well
/// within this; a source that recovers without a success to report (a resumed watch on a quiet
/// resource sends no event) stops counting after it.
pub const FORBIDDEN_EXPIRES_AFTER: Duration = Duration::from_secs(30);

/// How long the probe waits for `/version`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The source name of the probe's own reports.
const PROBE: &str = "probe";

/// What the hub's requests met, by kind of failure.
#[derive(Clone, Debug, Default)]
struct Reports {
    /// The last connection failure, until any request is answered.
    unreachable: Option<String>,
    /// The last 401, until an authenticated request succeeds.
    unauthorized: Option<String>,
    /// 403s by source (a watch, a Lease, the probe), each until that source succeeds or
    /// [`FORBIDDEN_EXPIRES_AFTER`] passes without another.
    forbidden: std::collections::BTreeMap<String, (String, tokio::time::Instant)>,
}

impl Reports {
    fn state(&self) -> HubState {
        if let Some(cause) = &self.unreachable {
            HubState::Unreachable(cause.clone())
        } else if let Some(message) = &self.unauthorized {
            HubState::Unauthorized(message.clone())
        } else if let Some((message, _)) = self.forbidden.values().next() {
            HubState::Forbidden(message.clone())
        } else {
            HubState::Up
        }
    }

    /// Whether writes may go out: the hub answers and authenticates (a 403 is the resource's
    /// business: other writes may still be allowed).
    fn writable(&self) -> bool {
        self.unreachable.is_none() && self.unauthorized.is_none()
    }
}

/// The message of a Status, for people: the message, else the reason.
fn status_message(status: &kube::core::Status) -> String {
    if status.message.is_empty() {
        status.reason.clone()
    } else {
        status.message.clone()
    }
}

/// An error and its causes as one line, `a: b: c`, without the `ServiceError:`-style prefixes
/// of kube's wrappers and without repeating a cause a message already shows. kube's `Display`
/// of a connection failure alone says `client error (Connect)`; the cause (`Connection
/// refused`, `invalid peer certificate: UnknownIssuer`) is in the chain.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(err);
    let mut top = true;
    while let Some(e) = next {
        next = e.source();
        // kube's own wrapper (`ServiceError: <cause>`) only prefixes its source.
        if top && next.is_some() && e.downcast_ref::<kube::Error>().is_some() {
            top = false;
            continue;
        }
        top = false;
        let text = e.to_string();
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// Whether the hub answers and accepts this process's credentials, from what every hub request
/// meets (the watches, the Lease, writes) and a `/version` probe while it does not.
///
/// Writers wait while the hub does not answer or rejects the credentials (401); a 403 does not
/// stop them, since it may concern one resource only. The readiness problem, the metric and one
/// log line per change come from [`HubHealth::monitor`].
#[derive(Clone)]
pub struct HubHealth {
    tx: Arc<watch::Sender<Reports>>,
}

impl Default for HubHealth {
    fn default() -> Self {
        Self::new()
    }
}

impl HubHealth {
    /// Starts as up: the first request or probe tells otherwise.
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(Reports::default())),
        }
    }

    /// The current state.
    pub fn state(&self) -> HubState {
        self.tx.borrow().state()
    }

    /// Whether writes may go out: the hub answers and accepts the credentials.
    pub fn is_up(&self) -> bool {
        self.tx.borrow().writable()
    }

    /// Applies `change`; receivers are told only when the state or writability changed.
    fn update(&self, change: impl FnOnce(&mut Reports)) {
        self.tx.send_if_modified(|reports| {
            let before = (reports.state(), reports.writable());
            change(reports);
            (reports.state(), reports.writable()) != before
        });
    }

    /// Records that a request of `source` (a watch, the Lease of a location) failed with `err`;
    /// returns the error's class. A connection failure marks the hub unreachable, a 401 marks
    /// the credentials rejected, a 403 marks `source` forbidden; other errors are the caller's.
    /// Use for requests every replica needs; per-object writes use [`HubHealth::report_write`].
    pub fn report(&self, source: &str, err: &kube::Error) -> crate::api_errors::ErrorClass {
        let class = crate::api_errors::classify(err);
        match err {
            kube::Error::Api(status) => self.report_status(source, status),
            _ if class == crate::api_errors::ErrorClass::Unreachable => {
                let cause = error_chain(err);
                self.update(|r| r.unreachable = Some(cause));
            }
            _ => {}
        }
        class
    }

    /// As [`HubHealth::report`], for a Status answered in a watch stream.
    pub fn report_status(&self, source: &str, status: &kube::core::Status) {
        let message = status_message(status);
        match status.code {
            401 => self.update(|r| {
                r.unreachable = None;
                r.unauthorized = Some(message);
            }),
            403 => self.update(|r| {
                r.unreachable = None;
                r.forbidden
                    .insert(source.to_owned(), (message, tokio::time::Instant::now()));
            }),
            _ => {}
        }
    }

    /// As [`HubHealth::report`], for a watcher error; returns its class (`transient` when it
    /// carries no API error).
    pub fn report_watch(&self, source: &str, err: &kube::runtime::watcher::Error) -> crate::api_errors::ErrorClass {
        use kube::runtime::watcher::Error as W;
        match err {
            W::InitialListFailed(e) | W::WatchStartFailed(e) | W::WatchFailed(e) => self.report(source, e),
            W::WatchError(status) => {
                self.report_status(source, status);
                crate::api_errors::classify(&kube::Error::Api(status.clone()))
            }
            W::NoResourceVersion => crate::api_errors::ErrorClass::Transient,
        }
    }

    /// Records a failed per-object write: a connection failure or a 401 concerns the process,
    /// a 403 only the object (a terminating namespace), so it is not recorded.
    pub fn report_write(&self, err: &kube::Error) {
        let global = match err {
            kube::Error::Api(status) => status.code == 401,
            _ => crate::api_errors::classify(err) == crate::api_errors::ErrorClass::Unreachable,
        };
        if global {
            self.report("writes", err);
        }
    }

    /// Records that a request of `source` succeeded: the hub answers and accepts the
    /// credentials, and `source` is no longer forbidden.
    pub fn report_ok(&self, source: &str) {
        self.update(|r| {
            r.unreachable = None;
            r.unauthorized = None;
            r.forbidden.remove(source);
        });
    }

    /// Forgets 403s not reported again within [`FORBIDDEN_EXPIRES_AFTER`] of `now`.
    fn expire(&self, now: tokio::time::Instant) {
        self.update(|r| {
            r.forbidden
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < FORBIDDEN_EXPIRES_AFTER);
        });
    }

    /// Resolves once writes may go out (immediately if they may).
    pub async fn wait_up(&self) {
        let mut rx = self.tx.subscribe();
        // An error means the sender is gone, which cannot happen while `self` holds it.
        let _ = rx.wait_for(Reports::writable).await;
    }

    /// Asks `/version` once (with a timeout) and records the outcome as the probe's.
    async fn probe_once(&self, hub: &Client) {
        match tokio::time::timeout(PROBE_TIMEOUT, hub.apiserver_version()).await {
            // `/version` is authenticated: an answer proves the credentials too.
            Ok(Ok(_)) => self.report_ok(PROBE),
            Ok(Err(err)) => {
                if crate::api_errors::classify(&err) == crate::api_errors::ErrorClass::Transient
                    && !matches!(err, kube::Error::Api(_))
                {
                    // Neither an answer nor a connection failure (say an exec credential plugin
                    // that fails): the process cannot reach the hub either way.
                    let cause = error_chain(&err);
                    self.update(|r| r.unreachable = Some(cause));
                } else {
                    self.report(PROBE, &err);
                }
            }
            Err(_) => {
                let cause = format!("no answer to GET /version within {}s", PROBE_TIMEOUT.as_secs());
                self.update(|r| r.unreachable = Some(cause));
            }
        }
    }

    /// Runs until `cancel` fires: probes `/version` at once and then every `every` while the hub
    /// does not answer or rejects the credentials, and on every change of [`HubState`] calls
    /// `on_change` (readiness, metrics). One line is logged per change of kind of state (up,
    /// unreachable, 401, 403), never per retry: warn when the hub becomes unreachable, error when
    /// it rejects the credentials or forbids a needed request, info when it is up again.
    /// `server` names the hub in them.
    ///
    /// While a 403 stands the probe goes on too (`/version` is allowed to every account, so only
    /// a transient refusal, an apiserver whose RBAC cache is still filling, stops it); a 403 of
    /// another source clears when that source succeeds, or expires
    /// ([`FORBIDDEN_EXPIRES_AFTER`]).
    pub async fn monitor(
        &self,
        hub: Client,
        server: &str,
        every: Duration,
        cancel: CancellationToken,
        on_change: impl Fn(&HubState),
    ) {
        let mut rx = self.tx.subscribe();
        let mut shown: Option<HubState> = None;
        let mut next_probe = tokio::time::Instant::now();
        loop {
            let now = tokio::time::Instant::now();
            self.expire(now);
            // Probe while anything is wrong, a 403 included: the probe's own 403 (a restarted
            // apiserver's RBAC cache not filled yet) clears on its next success.
            if now >= next_probe && (shown.is_none() || !self.state().is_up()) {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = self.probe_once(&hub) => {}
                }
                next_probe = tokio::time::Instant::now() + every;
            }
            rx.borrow_and_update();
            let state = self.state();
            if shown.as_ref() != Some(&state) {
                if !shown.as_ref().is_some_and(|s| s.same_kind(&state)) {
                    log_change(shown.as_ref(), &state, server);
                }
                on_change(&state);
                shown = Some(state.clone());
            }
            if state.is_up() {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
                // Something failed: probe at once.
                next_probe = tokio::time::Instant::now();
            } else {
                // The next probe (it is always ahead: set after each probe), or with only 403s,
                // which are not probed, the next look at their expiry.
                let wake = if self.is_up() {
                    tokio::time::Instant::now() + every
                } else {
                    next_probe
                };
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep_until(wake) => {}
                    changed = rx.changed() => if changed.is_err() { return },
                }
            }
        }
    }
}

/// The one line of a change of hub state.
fn log_change(before: Option<&HubState>, now: &HubState, server: &str) {
    match now {
        HubState::Up if before.is_none() => tracing::info!(cluster = "hub", server, "hub answers"),
        HubState::Up => tracing::info!(cluster = "hub", server, "hub answers again; resuming writes"),
        HubState::Unreachable(cause) => tracing::warn!(
            cluster = "hub",
            server,
            error = %cause,
            "hub unreachable; not ready and writing nothing until it answers"
        ),
        HubState::Unauthorized(message) => tracing::error!(
            cluster = "hub",
            server,
            status = 401,
            error = %message,
            "hub rejects the credentials of the hub kubeconfig (401 Unauthorized); not ready and writing nothing until it accepts them"
        ),
        HubState::Forbidden(message) => tracing::error!(
            cluster = "hub",
            server,
            status = 403,
            error = %message,
            "hub forbids a request this process needs (403 Forbidden); not ready until the hub RBAC allows it"
        ),
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

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.into(),
            reason: if code == 401 { "Unauthorized" } else { "Forbidden" }.into(),
            ..kube::core::Status::default()
        }))
    }

    fn refused() -> kube::Error {
        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        );
        kube::Error::Service(Box::new(io))
    }

    #[tokio::test(start_paused = true)]
    async fn hub_state_sums_up_what_the_requests_met() {
        let h = HubHealth::new();
        let server = "https://hub:6443";
        assert_eq!(h.state(), HubState::Up);
        assert!(h.is_up());

        // Nothing listens: unreachable, writes wait, until any request is answered.
        assert_eq!(
            h.report("copies", &refused()),
            crate::api_errors::ErrorClass::Unreachable
        );
        assert!(!h.is_up());
        assert_eq!(
            h.state().problem(server).unwrap(),
            "unreachable at https://hub:6443: Connection refused (os error 111)"
        );
        let waiter = {
            let h = h.clone();
            tokio::spawn(async move { h.wait_up().await })
        };
        h.report_ok("copies");
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();

        // A token the hub rejects: not up, writes wait, whichever request met it.
        assert_eq!(
            h.report("Lease replicator-dfw", &api_error(401, "Unauthorized")),
            crate::api_errors::ErrorClass::Forbidden
        );
        assert!(!h.is_up());
        let problem = h.state().problem(server).unwrap();
        assert!(
            problem.starts_with("credentials rejected (401 Unauthorized): https://hub:6443 "),
            "{problem}"
        );
        // Any authenticated success (the probe's /version) proves the credentials.
        h.report_ok(PROBE);
        assert_eq!(h.state(), HubState::Up);

        // An account without the role: forbidden for the source that met it; writes may go (a
        // 403 may concern one resource only).
        let message = r#"leases.coordination.k8s.io "replicator-dfw" is forbidden: User "system:serviceaccount:x:y" cannot get resource "leases""#;
        h.report("Lease replicator-dfw", &api_error(403, message));
        assert!(h.is_up(), "a 403 does not stop writes");
        assert_eq!(
            h.state().problem(server).unwrap(),
            format!("access forbidden (403 Forbidden): {message}")
        );
        h.report_ok("copies");
        h.report_ok(PROBE);
        assert!(
            matches!(h.state(), HubState::Forbidden(_)),
            "only its own source clears it"
        );
        h.report_ok("Lease replicator-dfw");
        assert_eq!(h.state(), HubState::Up);

        // A 403 not reported again expires (a resumed watch may have nothing to report).
        h.report("copies", &api_error(403, message));
        tokio::time::advance(FORBIDDEN_EXPIRES_AFTER - Duration::from_secs(1)).await;
        h.expire(tokio::time::Instant::now());
        assert!(matches!(h.state(), HubState::Forbidden(_)));
        tokio::time::advance(Duration::from_secs(1)).await;
        h.expire(tokio::time::Instant::now());
        assert_eq!(h.state(), HubState::Up);

        // Per-object writes: a 403 is the object's, a 401 or no answer the process's.
        h.report_write(&api_error(403, message));
        assert_eq!(h.state(), HubState::Up);
        h.report_write(&api_error(401, "Unauthorized"));
        assert!(matches!(h.state(), HubState::Unauthorized(_)));
    }

    #[test]
    fn error_chains_name_the_cause_once() {
        // What kube's Display of a refused connection hides: the causes.
        let chain = error_chain(&refused());
        assert_eq!(chain, "Connection refused (os error 111)");
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Outer(#[source] std::io::Error);
        let io = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let err = kube::Error::Service(Box::new(Outer(io)));
        assert_eq!(
            error_chain(&err),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
    }

    /// Answers every request on `listener` with `status` and `body` (closing each connection),
    /// telling `hits` after each.
    async fn answer_all(
        listener: tokio::net::TcpListener,
        status: &'static str,
        body: &'static str,
        hits: tokio::sync::mpsc::UnboundedSender<()>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut buf = vec![0u8; 4096];
            let _ = socket.read(&mut buf).await;
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
            let _ = socket.shutdown().await;
            if hits.send(()).is_err() {
                return;
            }
        }
    }

    /// Runs a monitor of `url` probing every 10 ms; returns the states it reports.
    fn monitor(url: &str) -> (tokio::sync::mpsc::UnboundedReceiver<HubState>, CancellationToken) {
        let client = counted_client(Config::new(url.parse().unwrap()), Role::Hub).unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let (server, stop) = (url.to_owned(), cancel.clone());
        tokio::spawn(async move {
            HubHealth::new()
                .monitor(client, &server, Duration::from_millis(10), stop, move |state| {
                    let _ = tx.send(state.clone());
                })
                .await;
        });
        (rx, cancel)
    }

    #[test]
    fn a_403_is_not_a_hub_outage() {
        assert!(HubState::Up.answers() && HubState::Up.is_up());
        let forbidden = HubState::Forbidden("leases is forbidden".into());
        assert!(forbidden.answers() && !forbidden.is_up());
        assert!(!HubState::Unauthorized("Unauthorized".into()).answers());
        assert!(!HubState::Unreachable("connection refused".into()).answers());
    }

    #[tokio::test]
    async fn a_hub_that_answers_is_up() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (hits, _seen) = tokio::sync::mpsc::unbounded_channel();
        let body = r#"{"major":"1","minor":"35","gitVersion":"v1.35.4","gitCommit":"","gitTreeState":"","buildDate":"","goVersion":"","compiler":"","platform":""}"#;
        tokio::spawn(answer_all(listener, "200 OK", body, hits));
        let (mut states, cancel) = monitor(&url);
        let first = tokio::time::timeout(Duration::from_secs(10), states.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first, HubState::Up);
        assert_eq!(first.problem(&url), None);
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_wrong_server_is_reported_unreachable_with_its_address() {
        // A port nobody listens on.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let (mut states, cancel) = monitor(&url);
        let first = tokio::time::timeout(Duration::from_secs(10), states.recv())
            .await
            .unwrap()
            .unwrap();
        let problem = first.problem(&url).unwrap_or_default();
        assert!(
            problem.starts_with(&format!("unreachable at {url}: ")) && problem.contains("onnection refused"),
            "{problem}"
        );
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_rejected_token_is_reported_once_and_probed_without_spinning() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (hits_tx, mut hits) = tokio::sync::mpsc::unbounded_channel();
        let body = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#;
        tokio::spawn(answer_all(listener, "401 Unauthorized", body, hits_tx));
        let started = std::time::Instant::now();
        let (mut states, cancel) = monitor(&url);
        let first = tokio::time::timeout(Duration::from_secs(10), states.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first, HubState::Unauthorized("Unauthorized".into()));
        assert_eq!(
            first.problem(&url).unwrap(),
            format!(
                "credentials rejected (401 Unauthorized): {url} does not accept the credentials of the hub kubeconfig (Unauthorized)"
            )
        );
        // Probed again and again, one probe per interval, and the same state is not reported
        // again.
        for _ in 0..5 {
            tokio::time::timeout(Duration::from_secs(10), hits.recv())
                .await
                .unwrap()
                .unwrap();
        }
        assert!(
            started.elapsed() >= Duration::from_millis(40),
            "5 probes 10 ms apart took {:?}",
            started.elapsed()
        );
        assert!(states.try_recv().is_err(), "a repeated 401 is no new state");
        cancel.cancel();
    }
}
