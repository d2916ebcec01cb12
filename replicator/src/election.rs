//! Leader election: one writer per location, decided on a Lease on the hub; and one writer of
//! `replicator membership`, on its own Lease ([`run_on`]).
//!
//! Leader election on a hub Lease per location; standbys keep warm caches and take over without a
//! relist. Every replica of a location runs its reflectors and queue all the
//! time; only the holder of Lease `replicator-<location>` (namespace `--lease-namespace` on the
//! hub) writes copies and sweeps. The Lease itself is handled by `kube-lease-manager`
//! (server-side apply, renewal `grace` seconds before expiry).
//!
//! Losing contact with the hub while leading steps down at once (the Lease may still be ours for
//! up to `duration`, but nobody can prove it), and the election is rejoined after a backoff; a
//! replica that still holds the Lease when the hub answers again is leader again immediately.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{api_errors::ErrorClass, cluster::HubHealth};

/// How one location's election is run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Namespace of the Lease on the hub (it must exist; `config/rbac/hub` creates it).
    pub namespace: String,
    /// This replica's identity, unique among the replicas of a location (the Lease holder).
    pub identity: String,
    /// How long a Lease stays valid after its last renewal (whole seconds, at least 2).
    pub duration: Duration,
    /// How long before expiry the holder renews (whole seconds, at least 1, below `duration`).
    pub grace: Duration,
}

/// Name of the Lease of `location`: `replicator-<location>` (a location is a DNS label, so the
/// name is valid).
pub fn lease_name(location: &str) -> String {
    format!("replicator-{location}")
}

/// The default identity: `$POD_NAME`, else the host name, else `replicator`. Stable across the
/// process's own restarts, so a replica restarted in its pod (a crash, an OOM kill, a kubelet
/// restart of the container) finds the Lease still held by itself and resumes leading at once
/// instead of waiting out the Lease. Two processes sharing a host outside Kubernetes must each
/// be given `--identity`: two replicas with one identity would both lead.
pub fn default_identity() -> String {
    identity_from(
        std::env::var("POD_NAME").ok(),
        std::fs::read_to_string("/proc/sys/kernel/hostname").ok(),
    )
}

/// [`default_identity`] from the values it reads: the first non-blank of `pod_name` and
/// `hostname`, trimmed; `replicator` when both are blank or absent.
pub fn identity_from(pod_name: Option<String>, hostname: Option<String>) -> String {
    [pod_name, hostname]
        .into_iter()
        .flatten()
        .map(|s| s.trim().to_owned())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "replicator".to_owned())
}

/// Checks `duration` and `grace` as the Lease manager needs them.
///
/// # Errors
/// A message when either is under a second, not whole seconds, or `grace` is not below
/// `duration`.
pub fn check_timing(duration: Duration, grace: Duration) -> Result<(), String> {
    if duration.subsec_nanos() != 0 || grace.subsec_nanos() != 0 {
        return Err("--lease-duration and --lease-grace are whole seconds".into());
    }
    if grace.as_secs() == 0 || duration.as_secs() < 2 {
        return Err("--lease-duration must be at least 2s and --lease-grace at least 1s".into());
    }
    if grace >= duration {
        return Err(format!(
            "--lease-grace ({}s) must be shorter than --lease-duration ({}s)",
            grace.as_secs(),
            duration.as_secs()
        ));
    }
    Ok(())
}

const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How long a Lease seen free, without a release having been watched, is left to this
/// replica's Lease manager before the election is rejoined. The manager may have read the Lease
/// while it was still held (a replica started just before the holder stopped) and then sleeps
/// until the old term would have expired; a fresh manager reads it anew and takes it.
const FREE_LEASE_GRACE: Duration = Duration::from_secs(1);

/// Where an election reports to.
pub struct Reports<C, E> {
    /// Told `true` when this replica becomes leader and `false` when it stops being one (also
    /// once at the start).
    pub on_change: C,
    /// Told the class of every failed Lease request (`replicator_errors_total{kind="Lease"}`).
    pub on_error: E,
    /// Told what the hub answered to the Lease requests: a 401 or 403 there (an account without
    /// the Lease role) or no answer makes the process not ready (see [`HubHealth::report`]).
    pub hub_health: HubHealth,
}

/// Takes part in the election of `location` until `cancel` fires, reporting to `reports`
/// (`on_change(true)` when this replica becomes leader, `on_change(false)` when it stops being
/// one, also once at the start). On cancel a held Lease is released, so a standby takes over
/// without waiting for expiry.
///
/// Errors never end the loop: leadership is given up, and the election is rejoined after a
/// backoff of 1 s doubling to 5 s (a Lease read is cheap, and a hub that returns should find its
/// writer again within seconds). Errors that are the hub's state (no answer, 401, 403) are
/// logged once per change by [`HubHealth::monitor`], others here.
pub async fn run(
    hub: Client,
    location: String,
    settings: Settings,
    cancel: CancellationToken,
    reports: Reports<impl Fn(bool), impl Fn(ErrorClass)>,
) {
    let lease = lease_name(&location);
    let span = tracing::info_span!("election", cluster = "hub", location = %location, lease = %lease);
    elect(hub, lease, settings, cancel, reports).instrument(span).await;
}

/// As [`run`], on the Lease named `lease` rather than a location's: `replicator membership`
/// elects its one writer among its replicas on `replicator.membership`
/// ([`crate::membership::LEASE`]).
pub async fn run_on(
    hub: Client,
    lease: String,
    settings: Settings,
    cancel: CancellationToken,
    reports: Reports<impl Fn(bool), impl Fn(ErrorClass)>,
) {
    let span = tracing::info_span!("election", cluster = "hub", lease = %lease);
    elect(hub, lease, settings, cancel, reports).instrument(span).await;
}

/// Reports a failed Lease request to `reports`; returns whether it is the hub's state (logged
/// by the monitor rather than at each retry).
fn report_error(reports: &Reports<impl Fn(bool), impl Fn(ErrorClass)>, source: &str, err: &LeaseManagerError) -> bool {
    let class = match err {
        LeaseManagerError::KubeError(e) => reports.hub_health.report(source, e),
        _ => ErrorClass::Transient,
    };
    (reports.on_error)(class);
    matches!(class, ErrorClass::Unreachable | ErrorClass::Forbidden)
}

async fn elect(
    hub: Client,
    lease: String,
    settings: Settings,
    cancel: CancellationToken,
    reports: Reports<impl Fn(bool), impl Fn(ErrorClass)>,
) {
    (reports.on_change)(false);
    let source = format!("Lease {}/{lease}", settings.namespace);
    let mut backoff = MIN_BACKOFF;
    loop {
        let built = tokio::select! {
            () = cancel.cancelled() => return,
            built = LeaseManagerBuilder::new(hub.clone(), lease.clone())
                .with_namespace(settings.namespace.clone())
                .with_identity(settings.identity.clone())
                .with_duration(settings.duration.as_secs())
                .with_grace(settings.grace.as_secs())
                .build() => built,
        };
        match built {
            Ok(manager) => {
                reports.hub_health.report_ok(&source);
                let followed = follow(&hub, &lease, &manager, &settings, &cancel, &reports, &mut backoff).await;
                match followed {
                    Followed::Cancelled => return,
                    // The holder let go: a fresh manager reads the Lease anew and takes it.
                    Followed::Released => continue,
                    Followed::Failed => {}
                }
            }
            Err(err) => {
                if report_error(&reports, &source, &err) {
                    tracing::debug!(error = %err, namespace = %settings.namespace, retry_in = ?backoff, "cannot read or create the Lease; not leading");
                } else {
                    tracing::warn!(
                        error = %err,
                        namespace = %settings.namespace,
                        retry_in = ?backoff,
                        "cannot read or create the Lease; not leading"
                    );
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// How following one Lease manager ended.
enum Followed {
    /// `cancel` fired (a held Lease was released).
    Cancelled,
    /// The Lease manager failed: rejoin after the backoff.
    Failed,
    /// While standing by, the Lease was seen released: rejoin at once.
    Released,
}

/// Follows one Lease manager until cancel, an error, or (standing by) the holder releasing the
/// Lease. The manager alone would sleep until the old term expires even after a release, so a
/// watch on the Lease cuts a graceful handover (a rollout) from `duration` to a round trip.
async fn follow(
    hub: &Client,
    lease: &str,
    manager: &LeaseManager,
    settings: &Settings,
    cancel: &CancellationToken,
    reports: &Reports<impl Fn(bool), impl Fn(ErrorClass)>,
    backoff: &mut Duration,
) -> Followed {
    let source = format!("Lease {}/{lease}", settings.namespace);
    let on_change = &reports.on_change;
    let api = Api::<Lease>::namespaced(hub.clone(), &settings.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={lease}"));
    let mut lease_events = watcher::watcher(api, config)
        .backoff(crate::cluster::watch_backoff())
        .applied_objects()
        .boxed();
    let mut leading = false;
    // A transition from held to free is a release: rejoin at once. A Lease free from the
    // start is the manager's to take, unless it read the Lease before the release and now waits
    // for the old term to end: after `FREE_LEASE_GRACE` without leading, rejoin. (Not at once:
    // the manager may be taking it right now, and rejoining would spin.)
    let mut seen_held = false;
    let mut free_since: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    // One `changed()` call lives until it returns: dropping it mid-renewal (as a `select!` that
    // re-creates it on every Lease event would) loses the renewal's answer, so the manager's
    // idea of the expiry stays old and it renews again at once: a renewal, an event, a renewal,
    // ~13 Lease requests per second per location (measured through
    // `replicator_api_requests_total{resource="leases"}`).
    let mut changed = Box::pin(manager.changed());
    loop {
        tokio::select! {
            event = lease_events.next() => {
                if let Some(Ok(seen)) = event {
                    let held = seen.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).is_some_and(|h| !h.is_empty());
                    if held {
                        seen_held = true;
                        free_since = None;
                    } else if seen_held && !leading {
                        tracing::info!("the Lease was released; taking part again at once");
                        return Followed::Released;
                    } else if !leading && free_since.is_none() {
                        free_since = Some(Box::pin(tokio::time::sleep(FREE_LEASE_GRACE)));
                    }
                }
            }
            () = async { if let Some(t) = free_since.as_mut() { t.await } }, if free_since.is_some() => {
                free_since = None;
                if !leading {
                    tracing::info!("the Lease is free and this replica's manager has not taken it; taking part again");
                    return Followed::Released;
                }
            }
            () = cancel.cancelled() => {
                // The pending call may hold the manager's state lock; release needs it.
                drop(changed);
                if leading {
                    on_change(false);
                }
                // Released even when this replica does not know it leads: the dropped call may
                // have taken the Lease on the hub before its answer was read (seen when a cell
                // leaves the election at once, finding its location claimed). The manager reads
                // the Lease first and clears it only if this identity holds it (or it expired).
                match tokio::time::timeout(Duration::from_secs(5), manager.release()).await {
                    Ok(Ok(())) if leading => tracing::info!("released the Lease"),
                    Ok(Ok(())) => {}
                    Ok(Err(err)) if leading => tracing::warn!(error = %err, "could not release the Lease; it expires by itself"),
                    Ok(Err(err)) => tracing::debug!(error = %err, "could not check the Lease on leaving"),
                    Err(_) if leading => tracing::warn!("releasing the Lease timed out; it expires by itself"),
                    Err(_) => tracing::debug!("checking the Lease on leaving timed out"),
                }
                return Followed::Cancelled;
            }
            result = &mut changed => {
                changed = Box::pin(manager.changed());
                match result {
                Ok(now) => {
                    reports.hub_health.report_ok(&source);
                    *backoff = MIN_BACKOFF;
                    leading = now;
                    if now {
                        free_since = None;
                        tracing::info!(identity = %settings.identity, "became leader: writing and sweeping");
                    } else {
                        tracing::info!(identity = %settings.identity, "lost the Lease: standing by with warm caches");
                    }
                    on_change(now);
                }
                Err(err) => {
                    let hub_state = report_error(reports, &source, &err);
                    if leading || !hub_state {
                        tracing::warn!(error = %err, retry_in = ?*backoff, "Lease renewal failed; stepping down");
                    } else {
                        tracing::debug!(error = %err, retry_in = ?*backoff, "Lease request failed; not leading");
                    }
                    if leading {
                        on_change(false);
                    }
                    return Followed::Failed;
                }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_and_identities() {
        assert_eq!(lease_name("dfw"), "replicator-dfw");
        let some = |s: &str| Some(s.to_owned());
        assert_eq!(
            identity_from(some("replicator-7d9f-x2x"), some("node-1\n")),
            "replicator-7d9f-x2x"
        );
        assert_eq!(identity_from(some(" "), some("node-1\n")), "node-1");
        assert_eq!(identity_from(None, some("node-1\n")), "node-1");
        assert_eq!(identity_from(None, None), "replicator");
        assert_eq!(identity_from(some(""), some("\n")), "replicator");
        // Stable across restarts: nothing of the process (its pid) is in it.
        assert!(!default_identity().contains(&std::process::id().to_string()));
    }

    #[test]
    fn timing_is_checked_before_the_lease_manager_sees_it() {
        let s = Duration::from_secs;
        assert_eq!(check_timing(s(15), s(5)), Ok(()));
        assert_eq!(check_timing(s(2), s(1)), Ok(()));
        assert!(check_timing(s(5), s(5)).unwrap_err().contains("shorter"));
        assert!(check_timing(s(1), s(1)).is_err());
        assert!(check_timing(s(10), s(0)).is_err());
        assert!(
            check_timing(Duration::from_millis(1500), s(1))
                .unwrap_err()
                .contains("whole")
        );
    }
}
