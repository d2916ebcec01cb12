//! `replicator membership`: NetworkService status and EndpointSlices on the hub (docs/architecture.md).
//!
//! Reflectors on the hub cache NetworkInterface copies, NetworkServices, the slices this
//! controller owns and namespaces; they only queue service keys. An interface change queues only
//! the services whose selector reaches it, before or after the change; a service, slice or
//! namespace change queues the services concerned. A worker resolves one service with the pure
//! [`rollup`] and [`endpoints`] transforms, applies the slices whose content differs (never one
//! whose name is held by a slice that is not the service's: [`endpoints::ownership`]), deletes
//! shards no longer wanted, then writes the status if it changed, whatever the slices did.
//! Events mark condition transitions; per-service gauges count members, healthy members, taken
//! and refused slices.
//!
//! Every replica runs the reflectors and the queue; only the holder of the hub Lease
//! ([`LEASE`], elected with [`crate::election::run_on`]) runs passes, so a standby takes over
//! with warm caches. Becoming leader queues every service once.

pub mod endpoints;
mod reconcile;
mod reflectors;
pub mod rollup;
mod run;
mod worker;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use k8s_openapi::{api::core::v1::Namespace, api::discovery::v1::EndpointSlice};
use kube::{
    Client,
    api::DynamicObject,
    core::Selector,
    runtime::{
        events::{Recorder, Reporter},
        reflector::{Store, store::Writer},
    },
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{
    api::{NetworkInterface, NetworkService},
    cluster,
    queue::WorkQueue,
};

/// Field manager of the status and slices this controller writes.
pub const FIELD_MANAGER: &str = "replicator-membership";

/// The hub Lease the membership replicas elect their writer on (in `--lease-namespace`). The
/// `.` keeps it apart from every `replicator-<location>` Lease of `replicator run` (a location
/// is a DNS label, so it has none).
pub const LEASE: &str = "replicator.membership";

/// Checks a Lease name: a DNS-1123 subdomain (dot-separated parts of lowercase alphanumerics
/// and `-`, at most 253 characters), as the apiserver requires.
///
/// # Errors
/// A message saying what a Lease name must be.
pub fn parse_lease_name(s: &str) -> Result<String, String> {
    let ok = s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a Lease name: lowercase letters, digits, '-' and '.', alphanumeric at each end of a part, at most 253"
        ))
    }
}

/// How soon a service whose slices are taken or refused is looked at again (the other slice
/// may go without an event this controller watches: a hand-made one carries none of its labels).
const RECHECK: Duration = Duration::from_secs(60);

/// Flags of `replicator membership`.
#[derive(Debug, clap::Args)]
pub struct MembershipArgs {
    /// Kubeconfig of the hub (required); waited for while missing or empty.
    #[arg(long, env = "REPLICATOR_HUB_KUBECONFIG")]
    pub hub_kubeconfig: PathBuf,
    /// Exit (status 0) once the content of --hub-kubeconfig differs from what the hub client was
    /// built from (read every 5 s; a missing or empty file is not a change), after the usual
    /// graceful shutdown (writes in flight finish): in a pod the kubelet restarts the container
    /// with the updated Secret, so a fixed kubeconfig needs no manual step. Set `false` under a
    /// supervisor that does not restart a process exiting 0: the file is then read once, at
    /// start.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "REPLICATOR_EXIT_ON_KUBECONFIG_CHANGE")]
    pub exit_on_kubeconfig_change: bool,
    /// Metrics and probe addresses.
    #[command(flatten)]
    pub serve: crate::http::ServeArgs,
    /// Concurrent service workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Elect one writer among the replicas on hub Lease `--lease-name`; standbys keep warm
    /// caches. With `false` this process writes unconditionally (run exactly one replica then).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "REPLICATOR_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Name of the Lease (default [`LEASE`], `replicator.membership`: its `.` keeps it apart
    /// from every `replicator-<location>` Lease of `replicator run`).
    #[arg(long, default_value = LEASE, value_parser = parse_lease_name)]
    pub lease_name: String,
    /// Namespace of the Lease on the hub (created by config/rbac/hub).
    #[arg(long, default_value = "replicator-system", env = "REPLICATOR_LEASE_NAMESPACE")]
    pub lease_namespace: String,
    /// How long the Lease stays valid without renewal: a killed leader is replaced within this
    /// (whole seconds, at least 2s).
    #[arg(long, default_value = "15s", value_parser = crate::runtime::parse_duration)]
    pub lease_duration: Duration,
    /// How long before expiry the leader renews (whole seconds, at least 1s, below
    /// --lease-duration).
    #[arg(long, default_value = "5s", value_parser = crate::runtime::parse_duration)]
    pub lease_grace: Duration,
    /// This replica's identity in the Lease: `$POD_NAME`, else the host name, when absent. It is
    /// stable across restarts, so a restarted replica resumes its own Lease at once; give each
    /// process its own when several run on one host outside Kubernetes.
    #[arg(long, env = "REPLICATOR_IDENTITY")]
    pub identity: Option<String>,
    /// Logging.
    #[command(flatten)]
    pub log: crate::runtime::LogArgs,
}

/// Labels of per-service gauges (the issue asks for them per service; bounded by services).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// Namespace of the service.
    pub namespace: String,
    /// Name of the service.
    pub service: String,
}

/// Labels of membership errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// The error class.
    pub class: &'static str,
}

/// Metrics of `replicator membership`.
#[derive(Clone)]
pub struct Metrics {
    /// `replicator_membership_members`: members of a service.
    pub members: Family<ServiceLabels, Gauge>,
    /// `replicator_membership_healthy`: healthy members of a service.
    pub healthy: Family<ServiceLabels, Gauge>,
    /// `replicator_membership_errors_total`: failed passes and hub watch attempts by class.
    pub errors: Family<ClassLabels, Counter>,
    /// `replicator_membership_hub_up`: 1 while the hub answers and accepts the credentials.
    pub hub_up: Gauge,
    /// `replicator_membership_status_writes_total`: status writes (unchanged status is skipped).
    pub status_writes: Counter,
    /// `replicator_membership_passes_total`: completed service passes.
    pub passes: Counter,
    /// `replicator_membership_slice_conflicts`: desired EndpointSlice names of a service held
    /// by a slice that is not its own (left untouched).
    pub slice_conflicts: Family<ServiceLabels, Gauge>,
    /// `replicator_membership_slices_rejected`: desired EndpointSlices of a service the hub
    /// refused in the last pass (invalid, forbidden).
    pub slices_rejected: Family<ServiceLabels, Gauge>,
    /// `replicator_membership_leader`: 1 while this replica holds the membership Lease (or runs
    /// with `--leader-elect=false`).
    pub leader: Gauge,
}

impl Metrics {
    /// Registers the metrics under the `replicator_membership_` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            members: Family::default(),
            healthy: Family::default(),
            errors: Family::default(),
            hub_up: Gauge::default(),
            status_writes: Counter::default(),
            passes: Counter::default(),
            slice_conflicts: Family::default(),
            slices_rejected: Family::default(),
            leader: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("replicator_membership");
        r.register("members", "Members of a NetworkService", m.members.clone());
        r.register("healthy", "Healthy members of a NetworkService", m.healthy.clone());
        r.register(
            "errors",
            "Failed service passes and hub watch attempts by class: unreachable (no answer), forbidden (401 credentials rejected, 403 no role), transient, invalid",
            m.errors.clone(),
        );
        r.register(
            "hub_up",
            "1 while the hub apiserver answers and accepts this process's credentials; 0 while it is unreachable or answers 401; a 403 to the watches keeps it 1 but the process not ready (/readyz names the reason)",
            m.hub_up.clone(),
        );
        r.register("status_writes", "NetworkService status writes", m.status_writes.clone());
        r.register("passes", "Completed service passes", m.passes.clone());
        r.register(
            "slice_conflicts",
            "Desired EndpointSlice names of a NetworkService held by a slice that is not its own (left untouched; condition SlicesPublished reason SliceNameConflict)",
            m.slice_conflicts.clone(),
        );
        r.register(
            "slices_rejected",
            "Desired EndpointSlices of a NetworkService the hub refused in the last pass (condition SlicesPublished reason SliceRejected)",
            m.slices_rejected.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the membership Lease and writes status and slices",
            m.leader.clone(),
        );
        m
    }
}

/// A service key: namespace and name.
type Key = (String, String);

/// The controller's caches and state.
pub struct Controller {
    hub: Client,
    hub_health: cluster::HubHealth,
    interfaces: Store<DynamicObject>,
    services: Store<DynamicObject>,
    slices: Store<EndpointSlice>,
    namespaces: Store<Namespace>,
    queue: Arc<WorkQueue<Key>>,
    matched: Mutex<HashMap<Key, HashSet<String>>>,
    attempts: Mutex<HashMap<Key, u32>>,
    listed: tokio::sync::watch::Sender<u8>,
    /// Whether this replica writes (it holds the Lease); workers wait while it is false.
    leader: tokio::sync::watch::Sender<bool>,
    metrics: Metrics,
    recorder: Recorder,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn interface_resource() -> kube::discovery::ApiResource {
    kube::discovery::ApiResource::erase::<NetworkInterface>(&())
}

fn service_resource() -> kube::discovery::ApiResource {
    kube::discovery::ApiResource::erase::<NetworkService>(&())
}

fn typed<K: serde::de::DeserializeOwned>(o: &DynamicObject) -> Option<K> {
    serde_json::to_value(o)
        .ok()
        .and_then(|v| serde_json::from_value(v).ok())
}

fn selector_of(service: &NetworkService) -> Result<Selector, String> {
    Selector::try_from(service.spec.network_interfaces.selector.clone()).map_err(|e| e.to_string())
}

/// The reflector writers of a [`Controller`], handed to its watch loops.
pub(crate) struct Writers {
    interfaces: Writer<DynamicObject>,
    services: Writer<DynamicObject>,
    slices: Writer<EndpointSlice>,
    namespaces: Writer<Namespace>,
}

impl Controller {
    /// A controller writing to `hub`, with empty caches, not leading; its reflectors are fed
    /// through the returned writers.
    pub(crate) fn new(hub: Client, hub_health: cluster::HubHealth, metrics: Metrics) -> (Arc<Controller>, Writers) {
        let writers = Writers {
            interfaces: Writer::new(interface_resource()),
            services: Writer::new(service_resource()),
            slices: Writer::default(),
            namespaces: Writer::default(),
        };
        let controller = Controller {
            interfaces: writers.interfaces.as_reader(),
            services: writers.services.as_reader(),
            slices: writers.slices.as_reader(),
            namespaces: writers.namespaces.as_reader(),
            queue: Arc::new(WorkQueue::new()),
            matched: Mutex::default(),
            attempts: Mutex::default(),
            listed: tokio::sync::watch::Sender::new(0),
            leader: tokio::sync::watch::Sender::new(false),
            metrics,
            recorder: Recorder::new(
                hub.clone(),
                Reporter {
                    controller: "replicator-membership".into(),
                    instance: None,
                },
            ),
            hub,
            hub_health,
        };
        (Arc::new(controller), writers)
    }
}

/// The readiness component of the first lists (the `hub` component is the hub's state).
const LISTS: &str = "hub caches";

/// Bitmask of the four reflectors that completed a full list.
const ALL_LISTED: u8 = 0b1111;

pub use run::run;

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn args(extra: &[&str]) -> Result<MembershipArgs, clap::Error> {
        let mut argv = vec!["replicator", "membership", "--hub-kubeconfig", "/h"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv)?.command {
            Command::Membership(args) => Ok(args),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn election_flags_default_to_one_lease_and_take_an_identity() {
        let d = args(&[]).unwrap();
        assert!(d.leader_elect);
        assert_eq!(d.lease_name, "replicator.membership");
        assert_eq!(d.lease_namespace, "replicator-system");
        assert_eq!(
            (d.lease_duration, d.lease_grace),
            (Duration::from_secs(15), Duration::from_secs(5))
        );
        assert_eq!(d.identity, None);
        let set = args(&[
            "--identity",
            "replicator-membership-7d9f-x2x",
            "--lease-name",
            "e2e.membership-1",
            "--lease-namespace",
            "replicator-e2e",
            "--lease-duration",
            "4s",
            "--lease-grace",
            "2",
            "--leader-elect=false",
        ])
        .unwrap();
        assert_eq!(set.identity.as_deref(), Some("replicator-membership-7d9f-x2x"));
        assert_eq!(set.lease_name, "e2e.membership-1");
        assert_eq!(set.lease_namespace, "replicator-e2e");
        assert_eq!(
            (set.lease_duration, set.lease_grace),
            (Duration::from_secs(4), Duration::from_secs(2))
        );
        assert!(!set.leader_elect);
        for bad in ["Membership", "a-", "a..b", "a_b", ""] {
            let err = args(&["--lease-name", bad]).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{bad:?}");
        }
        assert!(!LEASE.starts_with("replicator-"), "never a location's Lease name");
    }
}
