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
pub mod rollup;

use endpoints::Ownership;
use rollup::SlicesOutcome;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use futures::StreamExt;
use k8s_openapi::{api::core::v1::Namespace, api::discovery::v1::EndpointSlice, jiff::Timestamp};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, Preconditions},
    core::{Selector, SelectorExt},
    runtime::{
        WatchStreamExt,
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::{ObjectRef, Store, store::Writer},
        watcher::{self, Event},
    },
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{
    api::{NetworkInterface, NetworkService, NetworkServiceStatus},
    api_errors::{ErrorClass, classify},
    cluster, copy,
    health::Health,
    http,
    queue::WorkQueue,
    routing,
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

/// The readiness component of the first lists (the `hub` component is the hub's state).
const LISTS: &str = "hub caches";

/// Bitmask of the four reflectors that completed a full list.
const ALL_LISTED: u8 = 0b1111;

impl Controller {
    fn key_of(o: &impl ResourceExt) -> Key {
        (o.namespace().unwrap_or_default(), o.name_any())
    }

    fn mark_listed(&self, bit: u8) {
        self.listed.send_modify(|v| *v |= bit);
    }

    /// Services in `namespace` whose selector matches `labels`.
    fn services_matching(&self, namespace: &str, labels: &BTreeMap<String, String>) -> HashSet<String> {
        self.services
            .state_filter(|s| s.namespace().as_deref() == Some(namespace))
            .iter()
            .filter_map(|s| typed::<NetworkService>(s))
            .filter(|s| selector_of(s).is_ok_and(|sel| sel.matches(labels)))
            .map(|s| s.name_any())
            .collect()
    }

    /// Queues the services an interface reaches now or reached before this change.
    fn interface_changed(&self, ni: &DynamicObject, deleted: bool) {
        let key = Self::key_of(ni);
        let now = if deleted {
            HashSet::new()
        } else {
            self.services_matching(&key.0, ni.labels())
        };
        let before = {
            let mut matched = lock(&self.matched);
            if deleted {
                matched.remove(&key).unwrap_or_default()
            } else {
                matched.insert(key.clone(), now.clone()).unwrap_or_default()
            }
        };
        for service in now.union(&before) {
            self.queue.add((key.0.clone(), service.clone()));
        }
    }

    async fn watch<K>(
        self: Arc<Self>,
        api: Api<K>,
        config: watcher::Config,
        mut writer: Writer<K>,
        bit: u8,
        on_event: impl Fn(&Self, &Event<K>) + Send + 'static,
        cancel: CancellationToken,
    ) where
        K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        // Internal: the key of this watch's 403 in `HubHealth` (one per reflector).
        let source = format!("watch {bit:#06b}");
        let mut stream = watcher::watcher(api, config)
            .backoff(crate::cluster::watch_backoff())
            .boxed();
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return,
                next = stream.next() => next,
            };
            match next {
                None => return,
                Some(Err(err)) => {
                    let class = self.hub_health.report_watch(&source, &err);
                    self.metrics
                        .errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                    if matches!(class, ErrorClass::Unreachable | ErrorClass::Forbidden) {
                        // Logged once per change of the hub's state by `HubHealth::monitor`.
                        tracing::debug!(error = %err, class = class.metric_label(), "hub watch failed; retrying with backoff");
                    } else {
                        tracing::warn!(error = %err, class = class.metric_label(), "hub watch failed; retrying with backoff");
                    }
                }
                Some(Ok(event)) => {
                    if !matches!(event, Event::Init | Event::InitApply(_)) {
                        self.hub_health.report_ok(&source);
                    }
                    let event = event.modify(|o| o.managed_fields_mut().clear());
                    writer.apply_watcher_event(&event);
                    if matches!(event, Event::InitDone) {
                        self.mark_listed(bit);
                    }
                    on_event(&self, &event);
                }
            }
        }
    }

    /// Becoming leader queues every cached service: the standby's queue may have been drained
    /// by nothing, and a pass that changes nothing writes nothing.
    fn set_leader(&self, leading: bool) {
        self.metrics.leader.set(i64::from(leading));
        let was = self.leader.send_replace(leading);
        if leading && !was {
            for s in self.services.state() {
                self.queue.add(Controller::key_of(s.as_ref()));
            }
        }
    }

    async fn work(self: Arc<Self>, cancel: CancellationToken) {
        while let Some((key, _)) = self.queue.next().await {
            // Only the leader writes, once the caches are listed; a standby holds the key
            // (others wait queued, deduplicated) until it leads or the process stops.
            let mut listed = self.listed.subscribe();
            let mut leading = self.leader.subscribe();
            let ready = async {
                let _ = listed.wait_for(|v| *v == ALL_LISTED).await;
                let _ = leading.wait_for(|l| *l).await;
            };
            tokio::select! {
                () = cancel.cancelled() => {
                    self.queue.done(&key);
                    return;
                }
                () = ready => {}
            }
            let span = tracing::info_span!(
                "membership",
                cluster = "hub",
                kind = "NetworkService",
                namespace = %key.0,
                name = %key.1
            );
            let result = tracing::Instrument::instrument(self.reconcile(&key), span.clone()).await;
            match result {
                Ok(recheck) => {
                    lock(&self.attempts).remove(&key);
                    self.metrics.passes.inc();
                    if recheck {
                        self.queue.add_after(key.clone(), RECHECK);
                    }
                }
                Err(err) => {
                    let class = classify(&err);
                    self.metrics
                        .errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                    let attempt = {
                        let mut a = lock(&self.attempts);
                        let n = a.entry(key.clone()).or_insert(0);
                        *n = n.saturating_add(1);
                        *n
                    };
                    let delay = class.retry_after(attempt).unwrap_or(Duration::from_secs(30));
                    tracing::warn!(parent: &span, error = %err, class = class.metric_label(), retry_in = ?delay, "service pass failed");
                    self.queue.add_after(key.clone(), delay);
                }
            }
            self.queue.done(&key);
        }
    }

    /// One pass over one service: slices first, then the status, which is written (when it
    /// changed) whatever the slices did, so a refused or taken slice never freezes it. Returns
    /// whether to look again after [`RECHECK`] (a slice is taken or refused).
    ///
    /// # Errors
    /// The status write failing, or a transient slice failure (after the status is written).
    async fn reconcile(&self, key: &Key) -> Result<bool, kube::Error> {
        let (namespace, name) = key;
        let labels = ServiceLabels {
            namespace: namespace.clone(),
            service: name.clone(),
        };
        let Some(raw) = self
            .services
            .get(&ObjectRef::new_with(name, service_resource()).within(namespace))
        else {
            self.metrics.members.remove(&labels);
            self.metrics.healthy.remove(&labels);
            self.metrics.slice_conflicts.remove(&labels);
            self.metrics.slices_rejected.remove(&labels);
            return Ok(false);
        };
        if raw.metadata.deletion_timestamp.is_some() {
            return Ok(false);
        }
        let Some(service) = typed::<NetworkService>(&raw) else {
            tracing::warn!("service does not match the NetworkService schema; skipped until it changes");
            self.metrics
                .errors
                .get_or_create(&ClassLabels {
                    class: ErrorClass::Invalid.metric_label(),
                })
                .inc();
            return Ok(false);
        };
        let interfaces: Vec<NetworkInterface> = self
            .interfaces
            .state_filter(|i| i.namespace().as_deref() == Some(namespace.as_str()))
            .iter()
            .filter_map(|i| typed::<NetworkInterface>(i))
            .collect();
        let resolution = rollup::resolve(selector_of(&service), &interfaces);
        let members = resolution.members();
        self.metrics.members.get_or_create(&labels).set(members.len() as i64);
        self.metrics
            .healthy
            .get_or_create(&labels)
            .set(members.iter().filter(|m| m.healthy && m.location.is_some()).count() as i64);

        let routing_labels: BTreeMap<String, String> = self
            .namespaces
            .get(&ObjectRef::new(namespace))
            .and_then(|ns| routing::resolve(namespace, Some(ns.labels())).ok())
            .map(|r| {
                r.labels()
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let (outcome, transient) = match endpoints::desired(&service, members, &routing_labels) {
            Ok(desired) => self.apply_slices(&service, desired).await,
            Err(err) => {
                tracing::warn!(error = %err, "no EndpointSlice planned");
                let (outcome, transient) = self.apply_slices(&service, Vec::new()).await;
                let outcome = match outcome {
                    SlicesOutcome::Pending(m) => SlicesOutcome::Pending(m),
                    _ => SlicesOutcome::InvalidName(err.to_string()),
                };
                (outcome, transient)
            }
        };
        let (conflicts, rejected) = match &outcome {
            SlicesOutcome::Conflicts(c) => (c.len(), 0),
            SlicesOutcome::Rejected(r) => (0, r.len()),
            _ => (0, 0),
        };
        self.metrics
            .slice_conflicts
            .get_or_create(&labels)
            .set(conflicts as i64);
        self.metrics.slices_rejected.get_or_create(&labels).set(rejected as i64);
        let recheck = matches!(outcome, SlicesOutcome::Conflicts(_) | SlicesOutcome::Rejected(_));

        let previous = service.status.clone();
        let now = Timestamp::now();
        let status = rollup::status(service.metadata.generation, &resolution, previous.as_ref(), now);
        let status = rollup::with_slices(status, &outcome, service.metadata.generation, previous.as_ref(), now);
        if previous.as_ref() != Some(&status) {
            let api = Api::<NetworkService>::namespaced(self.hub.clone(), namespace);
            let body = json!({
                "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
                "kind": "NetworkService",
                "metadata": {"name": name, "namespace": namespace},
                "status": status,
            });
            api.patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&body))
                .await?;
            self.metrics.status_writes.inc();
            self.publish_transitions(&service, previous.as_ref(), &status).await;
        }
        match transient {
            Some(err) => Err(err),
            None => Ok(recheck),
        }
    }

    /// The slice of `name` in `namespace`: from the cache (slices carrying the network-service
    /// label), else read from the hub (a slice without the label, a hand-made one, is not
    /// cached but must not be overwritten either).
    async fn current_slice(
        &self,
        api: &Api<EndpointSlice>,
        namespace: &str,
        name: &str,
    ) -> Result<Option<EndpointSlice>, kube::Error> {
        if let Some(cached) = self.slices.get(&ObjectRef::new(name).within(namespace)) {
            return Ok(Some(cached.as_ref().clone()));
        }
        api.get_opt(name).await
    }

    /// Writes `desired` for `service` and deletes the slices it controls that are no longer
    /// desired. A name held by a slice that is not the service's is left untouched and reported
    /// ([`endpoints::ownership`]); a slice of the service whose `addressType` (immutable) differs
    /// is deleted (UID precondition) and created again. Every slice is tried; the outcome lists
    /// what is taken or refused, and the first transient error is returned beside it.
    async fn apply_slices(
        &self,
        service: &NetworkService,
        desired: Vec<EndpointSlice>,
    ) -> (SlicesOutcome, Option<kube::Error>) {
        let namespace = service.namespace().unwrap_or_default();
        let service_name = service.name_any();
        let uid = service.metadata.uid.clone().unwrap_or_default();
        let api = Api::<EndpointSlice>::namespaced(self.hub.clone(), &namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut conflicts = Vec::new();
        let mut rejected = Vec::new();
        let mut transient: Option<kube::Error> = None;
        let fail = |name: &str, err: kube::Error, rejected: &mut Vec<String>, transient: &mut Option<kube::Error>| {
            let class = classify(&err);
            match class {
                ErrorClass::Invalid | ErrorClass::Forbidden => {
                    self.metrics
                        .errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                    tracing::warn!(slice = name, error = %err, class = class.metric_label(), "the hub refused an EndpointSlice");
                    rejected.push(format!("EndpointSlice {name}: {}", error_message(&err)));
                }
                _ => {
                    if transient.is_none() {
                        *transient = Some(err);
                    }
                }
            }
        };
        let wanted: HashSet<String> = desired.iter().filter_map(|s| s.metadata.name.clone()).collect();
        for slice in desired {
            let Some(name) = slice.metadata.name.clone() else {
                continue;
            };
            let current = match self.current_slice(&api, &namespace, &name).await {
                Ok(c) => c,
                Err(err) => {
                    fail(&name, err, &mut rejected, &mut transient);
                    continue;
                }
            };
            match endpoints::ownership(current.as_ref(), &service_name, &uid) {
                Ownership::Taken(why) => {
                    tracing::warn!(slice = %name, reason = %why, "EndpointSlice name taken; not overwritten");
                    conflicts.push(why);
                    continue;
                }
                Ownership::Ours | Ownership::Free => {}
            }
            let mut body = match serde_json::to_value(&slice) {
                Ok(b) => b,
                Err(err) => {
                    fail(&name, kube::Error::SerdeError(err), &mut rejected, &mut transient);
                    continue;
                }
            };
            body["apiVersion"] = json!("discovery.k8s.io/v1");
            body["kind"] = json!("EndpointSlice");
            if let Some(c) = &current {
                let in_sync = serde_json::to_value(c)
                    .ok()
                    .is_some_and(|c| copy::contains(&c, &without_types(&body)) && endpoints_equal(&c, &body));
                if in_sync {
                    continue;
                }
                if c.address_type != slice.address_type {
                    let precondition = DeleteParams {
                        preconditions: Some(Preconditions {
                            uid: c.metadata.uid.clone(),
                            resource_version: None,
                        }),
                        ..DeleteParams::default()
                    };
                    match api.delete(&name, &precondition).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 404 => {}
                        Err(err) => {
                            fail(&name, err, &mut rejected, &mut transient);
                            continue;
                        }
                    }
                }
            }
            if let Err(err) = api.patch(&name, &params, &Patch::Apply(&body)).await {
                fail(&name, err, &mut rejected, &mut transient);
            }
        }
        let stale: Vec<Arc<EndpointSlice>> = self.slices.state_filter(|s| {
            s.namespace().as_deref() == Some(namespace.as_str())
                && !wanted.contains(&s.name_any())
                && s.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.uid == uid)
                && s.labels().get(endpoints::MANAGED_BY_LABEL).map(String::as_str) == Some(endpoints::MANAGED_BY)
        });
        for slice in stale {
            let precondition = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: slice.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&slice.name_any(), &precondition).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(err) => fail(&slice.name_any(), err, &mut rejected, &mut transient),
            }
        }
        let outcome = if let Some(err) = &transient {
            SlicesOutcome::Pending(error_message(err))
        } else if !rejected.is_empty() {
            conflicts.extend(rejected);
            SlicesOutcome::Rejected(conflicts)
        } else if !conflicts.is_empty() {
            SlicesOutcome::Conflicts(conflicts)
        } else {
            SlicesOutcome::Published
        };
        (outcome, transient)
    }

    async fn publish_transitions(
        &self,
        service: &NetworkService,
        previous: Option<&NetworkServiceStatus>,
        status: &NetworkServiceStatus,
    ) {
        let reference = service.object_ref(&());
        for c in status.conditions.iter().flatten() {
            let before = previous
                .and_then(|p| p.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|p| p.type_ == c.type_));
            if before.is_some_and(|b| b.status == c.status && b.reason == c.reason) {
                continue;
            }
            let event = KubeEvent {
                type_: if c.status == "True" {
                    EventType::Normal
                } else {
                    EventType::Warning
                },
                reason: c.reason.clone(),
                note: Some(
                    format!("{} is {}: {}", c.type_, c.status, c.message)
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "Resolve".into(),
                secondary: None,
            };
            if let Err(err) = self.recorder.publish(&event, &reference).await {
                tracing::debug!(error = %err, "failed to publish event");
            }
        }
    }
}

/// The apiserver's message of `err` (its status message), else the error's text.
fn error_message(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

fn without_types(body: &serde_json::Value) -> serde_json::Value {
    let mut b = body.clone();
    if let Some(map) = b.as_object_mut() {
        map.remove("apiVersion");
        map.remove("kind");
    }
    b
}

/// Endpoint lists must match exactly in length (the subset check already compares elements).
fn endpoints_equal(current: &serde_json::Value, desired: &serde_json::Value) -> bool {
    let len = |v: &serde_json::Value| v.get("endpoints").and_then(|e| e.as_array()).map_or(0, Vec::len);
    len(current) == len(desired)
}

/// Runs `replicator membership` until SIGTERM or SIGINT.
///
/// # Errors
/// An unbindable address; `--lease-duration`/`--lease-grace` the Lease cannot use.
pub async fn run(args: MembershipArgs) -> anyhow::Result<()> {
    if args.leader_elect {
        crate::election::check_timing(args.lease_duration, args.lease_grace).map_err(anyhow::Error::msg)?;
    }
    let identity = args.identity.clone().unwrap_or_else(crate::election::default_identity);
    let cancel = CancellationToken::new();
    crate::runtime::spawn_signal_handler(cancel.clone());
    let mut registry = Registry::default();
    crate::metrics::register_process(&mut registry);
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::default();
    health.set(
        "hub",
        format!("waiting for hub kubeconfig {}", args.hub_kubeconfig.display()),
    );
    let mut servers = http::spawn(&args.serve, registry, health.clone(), &cancel);

    let hub = cluster::wait_for_hub_client(&args.hub_kubeconfig, Duration::from_secs(2), &cancel, &health, "hub").await;
    let Some(cluster::Hub {
        client: hub,
        server,
        kubeconfig,
    }) = hub
    else {
        return Ok(());
    };
    health.set("hub", format!("connecting to {server}"));
    health.set(LISTS, "initial list pending");
    tracing::info!(server = %server, leader_elect = args.leader_elect, identity = %identity, "hub kubeconfig loaded; starting");
    let hub_health = cluster::HubHealth::new();
    let hub_health_for_election = hub_health.clone();

    let interfaces = Writer::new(interface_resource());
    let services = Writer::new(service_resource());
    let slices = Writer::<EndpointSlice>::default();
    let namespaces = Writer::<Namespace>::default();
    let controller = Arc::new(Controller {
        interfaces: interfaces.as_reader(),
        services: services.as_reader(),
        slices: slices.as_reader(),
        namespaces: namespaces.as_reader(),
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
        hub: hub.clone(),
        hub_health: hub_health.clone(),
    });

    let mut tasks = tokio::task::JoinSet::new();
    if args.exit_on_kubeconfig_change {
        tasks.spawn(crate::kubeconfig_watch::exit_on_change(
            args.hub_kubeconfig.clone(),
            kubeconfig,
            cancel.clone(),
        ));
    }
    {
        let (hub, cancel, health, hub_up) = (
            hub.clone(),
            cancel.clone(),
            health.clone(),
            controller.metrics.hub_up.clone(),
        );
        tasks.spawn(async move {
            let shown = server.clone();
            hub_health
                .monitor(hub, &server, Duration::from_secs(1), cancel, move |state| {
                    hub_up.set(i64::from(state.answers()));
                    match state.problem(&shown) {
                        None => health.clear("hub"),
                        Some(problem) => health.set("hub", problem),
                    }
                })
                .await;
        });
    }
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<DynamicObject>::all_with(hub.clone(), &interface_resource()),
            watcher::Config::default(),
            interfaces,
            0b0001,
            |c: &Controller, e: &Event<DynamicObject>| match e {
                Event::Apply(o) | Event::InitApply(o) => c.interface_changed(o, false),
                Event::Delete(o) => c.interface_changed(o, true),
                Event::Init | Event::InitDone => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "NetworkInterface"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<DynamicObject>::all_with(hub.clone(), &service_resource()),
            watcher::Config::default(),
            services,
            0b0010,
            |c: &Controller, e: &Event<DynamicObject>| match e {
                Event::Apply(o) | Event::InitApply(o) | Event::Delete(o) => c.queue.add(Controller::key_of(o)),
                Event::Init | Event::InitDone => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "NetworkService"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<EndpointSlice>::all(hub.clone()),
            watcher::Config::default().labels(endpoints::NETWORK_SERVICE_LABEL),
            slices,
            0b0100,
            |c: &Controller, e: &Event<EndpointSlice>| match e {
                Event::Apply(o) | Event::Delete(o) => {
                    for owner in o.owner_references().iter().filter(|o| o.kind == "NetworkService") {
                        c.queue.add((o.namespace().unwrap_or_default(), owner.name.clone()));
                    }
                }
                _ => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "EndpointSlice"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<Namespace>::all(hub.clone()),
            watcher::Config::default(),
            namespaces,
            0b1000,
            |c: &Controller, e: &Event<Namespace>| {
                if let Event::Apply(ns) = e {
                    for s in c
                        .services
                        .state_filter(|s| s.namespace().as_deref() == Some(ns.name_any().as_str()))
                    {
                        c.queue.add(Controller::key_of(s.as_ref()));
                    }
                }
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "Namespace"),
    ));
    {
        let (c, health, cancel) = (Arc::clone(&controller), health.clone(), cancel.clone());
        tasks.spawn(async move {
            let mut rx = c.listed.subscribe();
            tokio::select! {
                () = cancel.cancelled() => {}
                _ = rx.wait_for(|v| *v == ALL_LISTED) => {
                    health.clear(LISTS);
                    tracing::info!(services = c.services.len(), interfaces = c.interfaces.len(), "hub caches listed; resolving services");
                }
            }
        });
    }
    if args.leader_elect {
        let c = Arc::clone(&controller);
        let errors = controller.metrics.errors.clone();
        tasks.spawn(crate::election::run_on(
            hub.clone(),
            args.lease_name.clone(),
            crate::election::Settings {
                namespace: args.lease_namespace.clone(),
                identity: identity.clone(),
                duration: args.lease_duration,
                grace: args.lease_grace,
            },
            cancel.clone(),
            crate::election::Reports {
                on_change: move |leading| c.set_leader(leading),
                on_error: move |class: ErrorClass| {
                    errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                },
                hub_health: hub_health_for_election,
            },
        ));
    } else {
        controller.set_leader(true);
    }
    for _ in 0..args.workers.max(1) {
        tasks.spawn(Arc::clone(&controller).work(cancel.clone()));
    }

    let mut result = Ok(());
    tokio::select! {
        () = cancel.cancelled() => {}
        Some(served) = servers.join_next() => {
            if let Ok(Err(err)) = served {
                result = Err(err.into());
            }
            cancel.cancel();
        }
    }
    controller.queue.close();
    while tasks.join_next().await.is_some() {}
    while servers.join_next().await.is_some() {}
    result
}

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
