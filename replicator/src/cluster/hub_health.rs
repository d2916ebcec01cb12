//! Hub health: what the hub requests meet, summed up into a [`HubState`] that `/readyz`,
//! `replicator_hub_up` and the writers' pause follow, and the `/version` probe that watches for
//! its return (see the crate's `cluster` module for the whole story).

use std::{sync::Arc, time::Duration};

use kube::Client;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

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

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Config;

    use crate::cluster::{Role, counted_client};

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
