//! Mirroring of one cell onto the hub: reflectors feed a keyed queue, workers apply copies.
//!
//! Per rule (kind) a reflector watches the cell's sources (server-side filtered by the rule's
//! selector plus the loop guard) and another watches this location's copies on the hub, so an
//! edited or deleted copy is repaired at once. A third reflector watches the cell's namespaces
//! for project routing. Reflectors only update caches and queue keys: no hub write happens in a
//! watch loop (docs/architecture.md). Workers take a key, plan the copy with the pure [`crate::copy`]
//! transform and server-side apply it under the location's own field manager, so labels and
//! annotations Karmada writes on copies are never fought over, and a label the replicator stops
//! applying disappears because it owned it.
//!
//! Deletions: a watched delete (or an object gone after a relist) leaves a tombstone and the
//! worker withdraws the copy; copies whose source vanished while nothing watched are collected by
//! the sweep ([`crate::sweep`]). A hub outage pauses writers (see [`HubHealth`]); the latest
//! state per key stays queued and nothing is deleted because of it.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, Mutex, MutexGuard, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, DynamicObject, GetParams, ListParams, Patch, PatchParams, Preconditions},
    discovery::ApiResource,
    runtime::{
        WatchStreamExt,
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::{ObjectRef, Store, store::Writer},
        watcher::{self, Event},
    },
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    api_errors::{ErrorClass, classify, is_immutable_change},
    cache::{self, Cached},
    cluster::HubHealth,
    copy::{self, Plan},
    echo::{CopyId, Echoes, Seen},
    health::Health,
    metrics::{ErrorLabels, KindLabels, LocationLabels, Metrics, WriteLabels, WriteOp},
    queue::WorkQueue,
    routing::{self, UPSTREAM_CLUSTER_LABEL, UPSTREAM_NAMESPACE_LABEL},
    rules::{self, Rule},
};

/// A failed pass over one key.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A hub request failed.
    #[error("hub request failed: {0}")]
    Hub(#[source] kube::Error),
    /// An object of the copy's name on the hub is not this location's copy.
    #[error(
        "hub object {namespace}/{name} (the copy name of source {source_key} of location {location}) is {holder}, without label {label}={location}; refusing to touch it"
    )]
    NotOurs {
        /// Namespace of the hub object.
        namespace: String,
        /// Name of the hub object.
        name: String,
        /// The location label key.
        label: &'static str,
        /// This location.
        location: String,
        /// The source whose copy name it is, `namespace/name`.
        source_key: String,
        /// What the object is: another location's copy (naming its source and location) or an
        /// object the replicator did not publish.
        holder: String,
    },
    /// The copy under this location's label was published by another cell (one cell per
    /// location): never modified.
    #[error("hub copy {namespace}/{name} was published by another cell (kube-system UID {cell}); refusing to touch it")]
    OtherCell {
        /// Namespace of the copy.
        namespace: String,
        /// Name of the copy.
        name: String,
        /// The other cell's ID.
        cell: String,
    },
    /// The cell's identity is not known yet (no write goes out without it).
    #[error("the cell is not identified yet (its kube-system namespace is not listed)")]
    CellUnidentified,
    /// A confirming read of the cell failed (the copy it was about stays as it is).
    #[error("cell read failed: {0}")]
    Cell(#[source] kube::Error),
    /// The source cannot be turned into a copy.
    #[error("source cannot be copied: {0}")]
    Source(#[from] copy::Error),
    /// A cached object could not be read back (see [`crate::cache::Cached::object`]).
    #[error("cached {what} {namespace}/{name} is unreadable: {source}")]
    Cache {
        /// "source" or "copy".
        what: &'static str,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The parse error.
        source: serde_json::Error,
    },
}

impl Error {
    /// The class deciding retry, Event and metric.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Hub(e) => classify(e),
            // Retried with backoff; never taken for the hub being down.
            Self::Cell(_) => ErrorClass::Transient,
            Self::NotOurs { .. } | Self::OtherCell { .. } => ErrorClass::NotOurs,
            Self::CellUnidentified => ErrorClass::Transient,
            Self::Source(_) | Self::Cache { .. } => ErrorClass::SourceInvalid,
        }
    }
}

/// Objects per page of the reflectors' LISTs (kube-runtime's default is 500). A page is held
/// whole while its objects go into the cache, managedFields and all (about 10 KB per object
/// parsed), and a restart lists sources and copies of every kind at once: 500 per page left
/// 20 MB of a 10,000-object restart resident in each process; 100 keeps that to a few MB for
/// 50 LISTs of 100 instead of 10 of 500 (issue #5, measured with `replicator-bench memory`).
pub const LIST_PAGE: u32 = 100;

/// A queued unit of work: one source key of one rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// Index of the rule in [`CellSync::rules`].
    pub rule: usize,
    /// Source namespace (the copy's namespace too).
    pub namespace: String,
    /// Source name.
    pub name: String,
}

/// Settings of one cell's sync.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This cell's location (a DNS label): copy name suffix, location label, field manager.
    pub location: String,
    /// Concurrent hub writers.
    pub workers: usize,
}

/// Per-rule caches and state of one cell.
pub struct RuleState {
    /// The rule.
    pub rule: Rule,
    /// Its dynamic API resource.
    pub resource: ApiResource,
    /// Metric labels of this kind and location.
    pub labels: KindLabels,
    /// Sources in the cell (the reflector's cache, in compact form).
    pub sources: Store<Cached>,
    /// This location's copies on the hub (the reflector's cache, in compact form).
    pub copies: Store<Cached>,
    /// The source reflector completed a full list at least once.
    pub sources_listed: AtomicBool,
    /// The source reflector has had no error since its last full list.
    pub sources_healthy: AtomicBool,
    /// The hub copy reflector completed a full list at least once.
    pub copies_listed: AtomicBool,
    /// Unix seconds of the last source watch error (0: none).
    pub sources_last_error: std::sync::atomic::AtomicU64,
    tombstones: Mutex<HashSet<(String, String)>>,
    unroutable: Mutex<HashSet<(String, String)>>,
    /// Copies of this location's label on the hub that another cell published: (namespace,
    /// name) to that cell's ID. Normally empty; anything in it refuses every write.
    foreign: Mutex<BTreeMap<(String, String), String>>,
}

/// Whether this replica may write its location's copies (workers and the sweep wait on it).
///
/// Open when the replica leads its location (the election of `election.rs`, or always with
/// `--leader-elect=false`), the cell's copies are not withdrawn (the unreachable-cell policy
/// of `outage.rs`: withdrawn copies must not be written back from a stale cache), and no other
/// cell publishes the location (one cell per location).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteGate {
    /// This replica holds the location's Lease.
    pub leading: bool,
    /// The cell is unreachable and its copies were withdrawn.
    pub withdrawn: bool,
    /// Another cell publishes this location (its copies are on the hub): this one writes nothing.
    pub claimed_elsewhere: bool,
}

impl WriteGate {
    /// Whether writes may go out.
    pub fn open(self) -> bool {
        self.leading && !self.withdrawn && !self.claimed_elsewhere
    }
}

/// The reflector writers handed to [`CellSync::run`], one pair per rule plus namespaces.
pub struct Writers {
    sources: Vec<Writer<Cached>>,
    copies: Vec<Writer<Cached>>,
    namespaces: Writer<Namespace>,
}

/// A write to a copy in flight (see [`crate::echo`]): events of the copy are held until it
/// ends. Ending it, also when the pass fails, panics or is dropped, gives the source a pass if an
/// event held meanwhile was not the write's echo.
struct Writing<'a> {
    sync: &'a CellSync,
    key: &'a Key,
    id: CopyId,
}

impl<'a> Writing<'a> {
    fn begin(sync: &'a CellSync, key: &'a Key, copy_name: String) -> Writing<'a> {
        let id = (key.rule, key.namespace.clone(), copy_name);
        lock(&sync.echoes).begin(id.clone());
        Writing { sync, key, id }
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if lock(&self.sync.echoes).end(&self.id) {
            self.sync.queue.add(self.key.clone());
        }
    }
}

/// One cell mirrored onto the hub.
pub struct CellSync {
    /// Settings.
    pub settings: Settings,
    /// Rule states, indexed by [`Key::rule`].
    pub rules: Vec<RuleState>,
    cell: Client,
    hub: Client,
    hub_health: HubHealth,
    namespaces: Store<Namespace>,
    namespaces_listed: AtomicBool,
    /// The UID of the cell's `kube-system` namespace, recorded on every copy; known once the
    /// namespaces are listed, before the hub copies are watched.
    cell_id: OnceLock<String>,
    /// Whether the claim of another cell on this location was reported (Event, log).
    claim_reported: AtomicBool,
    queue: Arc<WorkQueue<Key>>,
    first_seen: Mutex<HashMap<Key, Instant>>,
    attempts: Mutex<HashMap<Key, u32>>,
    reported: Mutex<HashMap<Key, &'static str>>,
    deferred: Mutex<HashSet<Key>>,
    /// Our own hub writes, per (rule, namespace, copy name): their watch events (echoes) need
    /// no second pass.
    echoes: Mutex<Echoes>,
    readiness: watch::Sender<u64>,
    gate: watch::Sender<WriteGate>,
    metrics: Metrics,
    health: Health,
    recorder: Recorder,
    field_manager: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a single map operation, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

impl RuleState {
    /// Whether the sweep may trust the source cache: listed, and either no watch error since, or
    /// the last error is `quiet` old (a resumed watch on a quiet cell sends no event to prove it).
    pub fn sources_trusted(&self, quiet: Duration) -> bool {
        let last = self.sources_last_error.load(Ordering::Acquire);
        self.sources_listed.load(Ordering::Acquire)
            && (self.sources_healthy.load(Ordering::Acquire) || unix_now().saturating_sub(last) >= quiet.as_secs())
    }
}

impl CellSync {
    /// Builds the sync of one cell; call [`CellSync::run`] with the returned writers.
    pub fn new(
        settings: Settings,
        rules: Vec<Rule>,
        cell: Client,
        hub: Client,
        hub_health: HubHealth,
        metrics: Metrics,
        health: Health,
    ) -> (Arc<Self>, Writers) {
        let mut source_writers = Vec::new();
        let mut copy_writers = Vec::new();
        let states: Vec<RuleState> = rules
            .into_iter()
            .map(|rule| {
                let resource = rule.resource.api_resource();
                let sources = Writer::new(());
                let copies = Writer::new(());
                let state = RuleState {
                    labels: KindLabels {
                        kind: rule.resource.kind.clone(),
                        location: settings.location.clone(),
                    },
                    sources: sources.as_reader(),
                    copies: copies.as_reader(),
                    resource,
                    rule,
                    sources_listed: AtomicBool::new(false),
                    sources_healthy: AtomicBool::new(false),
                    copies_listed: AtomicBool::new(false),
                    sources_last_error: std::sync::atomic::AtomicU64::new(0),
                    tombstones: Mutex::default(),
                    unroutable: Mutex::default(),
                    foreign: Mutex::default(),
                };
                source_writers.push(sources);
                copy_writers.push(copies);
                state
            })
            .collect();
        let namespaces = Writer::<Namespace>::default();
        let recorder = Recorder::new(
            cell.clone(),
            Reporter {
                controller: "replicator".into(),
                instance: Some(settings.location.clone()),
            },
        );
        // Not ready until the first lists complete (bump_readiness clears it).
        health.set(&format!("cell {}", settings.location), "initial list pending");
        let depth = LocationLabels {
            location: settings.location.clone(),
        };
        let queue = Arc::new(WorkQueue::with_depth(metrics.queue_depth.get_or_create(&depth).clone()));
        // Exported from the start: 0 until another cell's copy is seen under this location.
        metrics.location_conflict.get_or_create(&depth).set(0);
        // The counters alerts take the increase of are exported at 0 from the start, so that
        // their first increment is an increase (a series born at 1 shows none) and a scrape
        // tells "nothing swept" from "no such metric".
        metrics.sweep_runs.get_or_create(&depth).inc_by(0);
        for state in &states {
            metrics.sweep_deleted.get_or_create(&state.labels).inc_by(0);
            metrics.withdrawn.get_or_create(&state.labels).inc_by(0);
        }
        let this = Self {
            field_manager: format!("replicator-{}", settings.location),
            settings,
            rules: states,
            cell,
            hub,
            hub_health,
            namespaces: namespaces.as_reader(),
            namespaces_listed: AtomicBool::new(false),
            cell_id: OnceLock::new(),
            claim_reported: AtomicBool::new(false),
            queue,
            first_seen: Mutex::default(),
            attempts: Mutex::default(),
            reported: Mutex::default(),
            deferred: Mutex::default(),
            echoes: Mutex::default(),
            readiness: watch::Sender::new(0),
            gate: watch::Sender::new(WriteGate::default()),
            metrics,
            health,
            recorder,
        };
        (
            Arc::new(this),
            Writers {
                sources: source_writers,
                copies: copy_writers,
                namespaces,
            },
        )
    }

    /// The cell client.
    pub fn cell(&self) -> &Client {
        &self.cell
    }

    /// The hub client.
    pub fn hub(&self) -> &Client {
        &self.hub
    }

    /// The metrics this sync records into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The field manager of this location's writes.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// Runs reflectors and workers until `cancel` fires.
    pub async fn run(self: Arc<Self>, writers: Writers, cancel: CancellationToken) {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, writer) in writers.sources.into_iter().enumerate() {
            tasks.spawn(Arc::clone(&self).watch_sources(i, writer, cancel.clone()));
        }
        tasks.spawn(Arc::clone(&self).watch_namespaces(writers.namespaces, cancel.clone()));
        // The hub copies are judged against this cell's identity, so they are watched once it is
        // known (the namespaces listed).
        let this = Arc::clone(&self);
        let copies_cancel = cancel.clone();
        tasks.spawn(async move {
            if this.identify_cell(&copies_cancel).await.is_none() {
                return;
            }
            let mut watchers = tokio::task::JoinSet::new();
            for (i, writer) in writers.copies.into_iter().enumerate() {
                watchers.spawn(Arc::clone(&this).watch_copies(i, writer, copies_cancel.clone()));
            }
            while watchers.join_next().await.is_some() {}
        });
        tasks.spawn(Arc::clone(&self).watch_hub_namespaces(cancel.clone()));
        for _ in 0..self.settings.workers.max(1) {
            tasks.spawn(Arc::clone(&self).work(cancel.clone()));
        }
        cancel.cancelled().await;
        self.queue.close();
        while tasks.join_next().await.is_some() {}
    }

    /// The UID of the cell's `kube-system` namespace (see [`copy::CELL_ANNOTATION`]), once known.
    pub fn cell_id(&self) -> Option<&str> {
        self.cell_id.get().map(String::as_str)
    }

    /// Whether `copy` is this location's copy from this cell ([`copy::published_by_cell`]); false
    /// while the cell is not identified.
    pub fn ours(&self, copy: &impl kube::Resource) -> bool {
        self.cell_id()
            .is_some_and(|cell| copy::published_by_cell(copy, &self.settings.location, cell))
    }

    /// Waits for the namespaces to list, then reads this cell's identity, the UID of its
    /// `kube-system` namespace, from the cache (no request, no extra permission). A cell without
    /// one keeps the replica not ready and is looked at again every 10 s. `None` when cancelled.
    async fn identify_cell(&self, cancel: &CancellationToken) -> Option<String> {
        let mut readiness = self.readiness.subscribe();
        tokio::select! {
            () = cancel.cancelled() => return None,
            _ = readiness.wait_for(|_| self.namespaces_listed.load(Ordering::Acquire)) => {}
        }
        let component = format!("cell {} identity", self.settings.location);
        loop {
            let uid = self
                .namespaces
                .get(&ObjectRef::new("kube-system"))
                .and_then(|ns| ns.uid())
                .filter(|uid| !uid.is_empty());
            if let Some(uid) = uid {
                self.health.clear(&component);
                tracing::info!(location = %self.settings.location, cell = %uid, "cell identified by its kube-system namespace");
                return Some(self.cell_id.get_or_init(|| uid).clone());
            }
            self.health.set(
                &component,
                "the cell has no kube-system namespace with a UID: its copies cannot be told from another cell's",
            );
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(Duration::from_secs(10)) => {}
            }
        }
    }

    /// Records whether hub copy `copy` of rule `state` is another cell's (see
    /// [`CellSync::update_claim`]); returns whether that changed the record.
    fn note_foreign(&self, state: &RuleState, copy: &DynamicObject, present: bool) -> bool {
        let id = (copy.namespace().unwrap_or_default(), copy.name_any());
        let other = copy::publishing_cell(copy)
            .filter(|cell| present && Some(*cell) != self.cell_id())
            .map(str::to_owned);
        let mut foreign = lock(&state.foreign);
        match other {
            Some(cell) => foreign.insert(id, cell.clone()).as_ref() != Some(&cell),
            None => foreign.remove(&id).is_some(),
        }
    }

    /// One cell per location: while any copy under this location's label was published by
    /// another cell, this replica writes nothing (the write gate), is not ready, exports
    /// `replicator_location_conflict{location} 1` and, once per claim, logs an error and puts a
    /// `LocationClaimed` Event on one of those copies on the hub. Nothing is withdrawn.
    async fn update_claim(&self) {
        // (rule, namespace, name, other cell) of one foreign copy, and how many there are.
        let mut first: Option<(usize, String, String, String)> = None;
        let mut n = 0;
        for (i, state) in self.rules.iter().enumerate() {
            let foreign = lock(&state.foreign);
            n += foreign.len();
            if first.is_none()
                && let Some(((namespace, name), cell)) = foreign.iter().next()
            {
                first = Some((i, namespace.clone(), name.clone(), cell.clone()));
            }
        }
        let location = &self.settings.location;
        let component = format!("location {location}");
        let claimed = first.is_some();
        self.gate
            .send_if_modified(|g| std::mem::replace(&mut g.claimed_elsewhere, claimed) != claimed);
        self.metrics
            .location_conflict
            .get_or_create(&LocationLabels {
                location: location.clone(),
            })
            .set(i64::from(claimed));
        let Some((rule, namespace, name, other)) = first else {
            self.health.clear(&component);
            if self.claim_reported.swap(false, Ordering::AcqRel) {
                tracing::info!(location = %location, "no copy of another cell is left under this location; writing again");
            }
            return;
        };
        let ours = self.cell_id().unwrap_or_default();
        let kind = &self.rules[rule].resource.kind;
        let message = format!(
            "location {location} is published by another cell (kube-system UID {other}; {n} copies, e.g. \
             {kind} {namespace}/{name}); this cell ({ours}) refuses to write. Give each cell its own --location"
        );
        self.health.set(&component, message.clone());
        if !self.claim_reported.swap(true, Ordering::AcqRel) {
            tracing::error!(location = %location, cell = %ours, other_cell = %other, copies = n, "{message}");
            self.publish_hub_event(rule, &namespace, &name, "LocationClaimed", &message)
                .await;
        }
    }

    /// Publishes a Warning Event on the hub about copy `namespace/name` of rule `rule`.
    async fn publish_hub_event(&self, rule: usize, namespace: &str, name: &str, reason: &str, note: &str) {
        let state = &self.rules[rule];
        let uid = state
            .copies
            .get(&cache::key(namespace, name))
            .and_then(|c| c.uid().map(str::to_owned));
        let reference = ObjectReference {
            api_version: Some(state.resource.api_version.clone()),
            kind: Some(state.resource.kind.clone()),
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
            uid,
            resource_version: None,
            field_path: None,
        };
        let recorder = Recorder::new(
            self.hub.clone(),
            Reporter {
                controller: "replicator".into(),
                instance: Some(self.settings.location.clone()),
            },
        );
        let event = KubeEvent {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: "Mirror".into(),
            secondary: None,
        };
        if let Err(err) = recorder.publish(&event, &reference).await {
            tracing::warn!(error = %err, "failed to publish an Event on the hub");
        }
    }

    /// Queues the keys parked while their kind's caches had not listed, for kinds that have now.
    fn release_deferred(&self) {
        let ready: Vec<Key> = {
            let mut deferred = lock(&self.deferred);
            let ready: Vec<Key> = deferred.iter().filter(|k| self.is_listed(k.rule)).cloned().collect();
            for k in &ready {
                deferred.remove(k);
            }
            ready
        };
        for key in ready {
            self.queue.add(key);
        }
    }

    /// Re-evaluates readiness after a cache completed a list.
    ///
    /// The evaluation and the health update happen inside the readiness channel's write lock:
    /// reflectors of several kinds finish their lists concurrently, and a caller that read the
    /// flags before another's list completed must not overwrite the later "ready" verdict with
    /// its stale "pending" one (seen in CI: a process stayed unready with every list done).
    fn bump_readiness(&self) {
        let key = format!("cell {}", self.settings.location);
        self.readiness.send_modify(|v| {
            *v = v.wrapping_add(1);
            let problems: Vec<String> = self
                .rules
                .iter()
                .filter(|r| !r.sources_listed.load(Ordering::Acquire) || !r.copies_listed.load(Ordering::Acquire))
                .map(|r| r.rule.resource.kind.clone())
                .collect();
            if problems.is_empty() && self.namespaces_listed.load(Ordering::Acquire) {
                self.health.clear(&key);
            } else {
                self.health
                    .set(&key, format!("initial list pending for {problems:?} or namespaces"));
            }
        });
        self.release_deferred();
    }

    /// Whether the caches a key of `rule` needs have all completed a full list.
    pub fn is_listed(&self, rule: usize) -> bool {
        self.namespaces_listed.load(Ordering::Acquire)
            && self
                .rules
                .get(rule)
                .is_some_and(|r| r.sources_listed.load(Ordering::Acquire) && r.copies_listed.load(Ordering::Acquire))
    }

    /// Whether every rule's caches have completed a full list.
    pub fn all_listed(&self) -> bool {
        (0..self.rules.len()).all(|i| self.is_listed(i))
    }

    /// Resolves once every rule's caches have completed a full list.
    pub async fn wait_listed(&self) {
        let mut rx = self.readiness.subscribe();
        let _ = rx.wait_for(|_| self.all_listed()).await;
    }

    fn enqueue(&self, key: Key, observed: Option<Instant>) {
        if let Some(at) = observed {
            lock(&self.first_seen).entry(key.clone()).or_insert(at);
        }
        self.queue.add(key);
    }

    async fn watch_sources(self: Arc<Self>, i: usize, mut writer: Writer<Cached>, cancel: CancellationToken) {
        let state = &self.rules[i];
        let kind = state.rule.resource.kind.clone();
        let span = tracing::info_span!("sources", cluster = "cell", location = %self.settings.location, kind = %kind);
        let selector = match rules::source_selector(&state.rule) {
            Ok(s) => s,
            Err(err) => {
                // Rules are validated at start-up, so this is unreachable in practice.
                tracing::error!(parent: &span, error = %err, "invalid source selector; not watching");
                return;
            }
        };
        let api = Api::<DynamicObject>::all_with(self.cell.clone(), &state.resource);
        let config = watcher::Config::default().labels_from(&selector).page_size(LIST_PAGE);
        let mut stream = watcher::watcher(api, config)
            .backoff(crate::cluster::watch_backoff())
            .boxed();
        let mut relisting: Option<Vec<Key>> = None;
        let mut before_relist: HashSet<(String, String)> = HashSet::new();
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return,
                next = stream.next() => next,
            };
            let Some(next) = next else { return };
            let now = Instant::now();
            match next {
                Err(err) => {
                    state.sources_healthy.store(false, Ordering::Release);
                    state.sources_last_error.store(unix_now(), Ordering::Release);
                    self.metrics.source_up.get_or_create(&state.labels).set(0);
                    self.count_error(state, ErrorClass::Transient);
                    tracing::warn!(parent: &span, error = %err, "cell watch failed; retrying with backoff");
                }
                Ok(event) => {
                    let event = event.modify(|o| o.managed_fields_mut().clear());
                    writer.apply_watcher_event(&cache::event(&event));
                    // An event after an error means the watch resumed (a resumed watch does not
                    // relist, so InitDone alone would leave the kind unhealthy forever).
                    if state.sources_listed.load(Ordering::Acquire)
                        && !matches!(event, Event::Init | Event::InitApply(_))
                        && !state.sources_healthy.swap(true, Ordering::AcqRel)
                    {
                        self.metrics.source_up.get_or_create(&state.labels).set(1);
                    }
                    match &event {
                        Event::Init => {
                            before_relist = if state.sources_listed.load(Ordering::Acquire) {
                                state
                                    .sources
                                    .state()
                                    .iter()
                                    .map(|o| (o.namespace().unwrap_or_default().to_owned(), o.name().to_owned()))
                                    .collect()
                            } else {
                                HashSet::new()
                            };
                            relisting = Some(Vec::new());
                        }
                        Event::InitApply(o) => {
                            let key = self.key(i, o);
                            lock(&state.tombstones).remove(&(key.namespace.clone(), key.name.clone()));
                            lock(&self.first_seen).entry(key.clone()).or_insert(now);
                            relisting.get_or_insert_with(Vec::new).push(key);
                        }
                        Event::InitDone => {
                            // The store swapped in the full list: queue every key against it, and
                            // treat keys that vanished during a watch gap as watched deletes.
                            let listed = relisting.take().unwrap_or_default();
                            let present: HashSet<(String, String)> =
                                listed.iter().map(|k| (k.namespace.clone(), k.name.clone())).collect();
                            for (namespace, name) in before_relist.drain().filter(|k| !present.contains(k)) {
                                lock(&state.tombstones).insert((namespace.clone(), name.clone()));
                                self.enqueue(
                                    Key {
                                        rule: i,
                                        namespace,
                                        name,
                                    },
                                    Some(now),
                                );
                            }
                            for key in listed {
                                self.queue.add(key);
                            }
                            state.sources_listed.store(true, Ordering::Release);
                            state.sources_healthy.store(true, Ordering::Release);
                            self.metrics.source_up.get_or_create(&state.labels).set(1);
                            tracing::info!(parent: &span, objects = state.sources.len(), "cell list complete");
                            self.bump_readiness();
                        }
                        Event::Apply(o) => {
                            let key = self.key(i, o);
                            lock(&state.tombstones).remove(&(key.namespace.clone(), key.name.clone()));
                            self.enqueue(key, Some(now));
                        }
                        Event::Delete(o) => {
                            let key = self.key(i, o);
                            lock(&state.tombstones).insert((key.namespace.clone(), key.name.clone()));
                            self.enqueue(key, Some(now));
                        }
                    }
                }
            }
        }
    }

    async fn watch_copies(self: Arc<Self>, i: usize, mut writer: Writer<Cached>, cancel: CancellationToken) {
        let state = &self.rules[i];
        let span = tracing::info_span!("copies", cluster = "hub", location = %self.settings.location, kind = %state.rule.resource.kind);
        let source = format!("{} copies of {}", state.rule.resource.kind, self.settings.location);
        let api = Api::<DynamicObject>::all_with(self.hub.clone(), &state.resource);
        let config = watcher::Config::default()
            .labels(&format!("{}={}", rules::LOCATION_LABEL, self.settings.location))
            .page_size(LIST_PAGE);
        let mut stream = watcher::watcher(api, config)
            .backoff(crate::cluster::watch_backoff())
            .boxed();
        let mut relisting: Vec<Key> = Vec::new();
        let mut before_relist: HashSet<Key> = HashSet::new();
        let mut relisted_foreign: BTreeMap<(String, String), String> = BTreeMap::new();
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return,
                next = stream.next() => next,
            };
            let Some(next) = next else { return };
            match next {
                Err(err) => {
                    let class = self.hub_health.report_watch(&source, &err);
                    self.count_error(state, class);
                    if matches!(class, ErrorClass::Unreachable | ErrorClass::Forbidden) {
                        // The hub's state (unreachable, 401, 403) is logged once per change by
                        // `HubHealth::monitor`, not once per retry.
                        tracing::debug!(parent: &span, error = %err, class = class.metric_label(), "hub watch failed; retrying with backoff");
                    } else {
                        tracing::warn!(parent: &span, error = %err, class = class.metric_label(), "hub watch failed; retrying with backoff");
                    }
                }
                Ok(event) => {
                    if !matches!(event, Event::Init | Event::InitApply(_)) {
                        self.hub_health.report_ok(&source);
                    }
                    let event = event.modify(|o| o.managed_fields_mut().clear());
                    writer.apply_watcher_event(&cache::event(&event));
                    match &event {
                        Event::Init => {
                            relisting.clear();
                            relisted_foreign.clear();
                            // Copies deleted on the hub during a watch gap vanish from the relist
                            // without a Delete event: remember what was there to repair them.
                            before_relist = if state.copies_listed.load(Ordering::Acquire) {
                                state
                                    .copies
                                    .state()
                                    .iter()
                                    .filter_map(|c| c.object().ok())
                                    .filter_map(|c| self.source_key_of_copy(i, &c))
                                    .collect()
                            } else {
                                HashSet::new()
                            };
                        }
                        Event::InitApply(o) => {
                            relisting.extend(self.source_key_of_copy(i, o));
                            if let Some(cell) = copy::publishing_cell(o).filter(|c| Some(*c) != self.cell_id()) {
                                relisted_foreign
                                    .insert((o.namespace().unwrap_or_default(), o.name_any()), cell.to_owned());
                            }
                        }
                        Event::InitDone => {
                            // A relist skips events: echoes still awaited never come.
                            lock(&self.echoes).forget_rule(i);
                            for key in &relisting {
                                before_relist.remove(key);
                            }
                            for key in relisting.drain(..).chain(before_relist.drain()) {
                                self.queue.add(key);
                            }
                            *lock(&state.foreign) = std::mem::take(&mut relisted_foreign);
                            self.update_claim().await;
                            state.copies_listed.store(true, Ordering::Release);
                            self.bump_readiness();
                        }
                        Event::Apply(o) => {
                            // Only a change of the record is worth a look at the claim: this runs
                            // for every copy event.
                            if self.note_foreign(state, o, true) {
                                self.update_claim().await;
                            }
                            // Our own write coming back needs no second pass; any other change
                            // (an edit, Karmada's labels) is checked against the source.
                            if let Some(key) = self.source_key_of_copy(i, o)
                                && self.needs_pass(i, o)
                            {
                                self.queue.add(key);
                            }
                        }
                        Event::Delete(o) => {
                            if self.note_foreign(state, o, false) {
                                self.update_claim().await;
                            }
                            lock(&self.echoes).forget(&(i, o.namespace().unwrap_or_default(), o.name_any()));
                            // A copy whose source is gone from the cell cache was withdrawn (by us,
                            // or its withdraw is queued): a pass would find nothing to do. Only a
                            // copy deleted under a live source is published again.
                            if let Some(key) = self.source_key_of_copy(i, o)
                                && state.sources.get(&cache::key(&key.namespace, &key.name)).is_some()
                            {
                                self.queue.add(key);
                            }
                        }
                    }
                    self.metrics
                        .copies
                        .get_or_create(&state.labels)
                        .set(state.copies.len() as i64);
                }
            }
        }
    }

    async fn watch_namespaces(self: Arc<Self>, mut writer: Writer<Namespace>, cancel: CancellationToken) {
        let span =
            tracing::info_span!("namespaces", cluster = "cell", location = %self.settings.location, kind = "Namespace");
        let api = Api::<Namespace>::all(self.cell.clone());
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .backoff(crate::cluster::watch_backoff())
            .boxed();
        let mut routing_of: HashMap<String, (Option<String>, Option<String>)> = HashMap::new();
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return,
                next = stream.next() => next,
            };
            let Some(next) = next else { return };
            match next {
                Err(err) => {
                    tracing::warn!(parent: &span, error = %err, "cell namespace watch failed; retrying with backoff")
                }
                Ok(event) => {
                    let event = event.modify(|o| o.managed_fields_mut().clear());
                    writer.apply_watcher_event(&event);
                    match &event {
                        Event::Apply(ns) | Event::InitApply(ns) => {
                            let labels = ns.labels();
                            let routing = (
                                labels.get(UPSTREAM_CLUSTER_LABEL).cloned(),
                                labels.get(UPSTREAM_NAMESPACE_LABEL).cloned(),
                            );
                            let name = ns.name_any();
                            let changed = routing_of.get(&name) != Some(&routing);
                            routing_of.insert(name.clone(), routing);
                            if changed && self.namespaces_listed.load(Ordering::Acquire) {
                                self.requeue_namespace(&name);
                            }
                        }
                        Event::Delete(ns) => {
                            routing_of.remove(&ns.name_any());
                        }
                        Event::Init => {}
                        Event::InitDone => {
                            if !self.namespaces_listed.swap(true, Ordering::AcqRel) {
                                tracing::info!(parent: &span, namespaces = routing_of.len(), "cell namespaces listed");
                            }
                            self.bump_readiness();
                        }
                    }
                }
            }
        }
    }

    /// Watches hub namespaces: when one appears, the sources of that namespace are queued at once
    /// instead of waiting out the backoff of their `namespace_missing` failures (the replicator
    /// never creates hub namespaces; it waits for them).
    async fn watch_hub_namespaces(self: Arc<Self>, cancel: CancellationToken) {
        let span = tracing::info_span!("hub-namespaces", cluster = "hub", location = %self.settings.location, kind = "Namespace");
        let api = Api::<kube::core::PartialObjectMeta<Namespace>>::all(self.hub.clone());
        let mut stream = watcher::watcher(api, watcher::Config::default())
            .backoff(crate::cluster::watch_backoff())
            .boxed();
        let mut known: HashSet<String> = HashSet::new();
        let mut listed = false;
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return,
                next = stream.next() => next,
            };
            match next {
                None => return,
                Some(Err(err)) => {
                    tracing::debug!(parent: &span, error = %err, "hub namespace watch failed; retrying with backoff")
                }
                Some(Ok(Event::Apply(ns) | Event::InitApply(ns))) => {
                    let name = ns.name_any();
                    if known.insert(name.clone()) && listed {
                        self.requeue_namespace(&name);
                    }
                }
                Some(Ok(Event::Delete(ns))) => {
                    known.remove(&ns.name_any());
                }
                Some(Ok(Event::InitDone)) => listed = true,
                Some(Ok(Event::Init)) => {}
            }
        }
    }

    /// Queues every source in `namespace`, of every rule (its routing labels changed).
    fn requeue_namespace(&self, namespace: &str) {
        let now = Instant::now();
        for (i, state) in self.rules.iter().enumerate() {
            for o in state.sources.state_filter(|o| o.namespace() == Some(namespace)) {
                self.enqueue(
                    Key {
                        rule: i,
                        namespace: namespace.to_owned(),
                        name: o.name().to_owned(),
                    },
                    Some(now),
                );
            }
        }
    }

    /// Whether the watch event of `copy` needs a pass over its source: not for the echo of one
    /// of our writes, nor (yet) for an event while one is in flight (see [`crate::echo`]).
    fn needs_pass(&self, rule: usize, copy: &DynamicObject) -> bool {
        let Some(rv) = copy.resource_version() else {
            return true;
        };
        let id = (rule, copy.namespace().unwrap_or_default(), copy.name_any());
        lock(&self.echoes).observe(&id, &rv) == Seen::Change
    }

    fn key(&self, rule: usize, o: &DynamicObject) -> Key {
        Key {
            rule,
            namespace: o.namespace().unwrap_or_default(),
            name: o.name_any(),
        }
    }

    fn source_key_of_copy(&self, rule: usize, copy: &DynamicObject) -> Option<Key> {
        let annotations = copy.annotations();
        let namespace = annotations.get(copy::SOURCE_NAMESPACE_ANNOTATION)?;
        let name = annotations.get(copy::SOURCE_NAME_ANNOTATION)?;
        Some(Key {
            rule,
            namespace: namespace.clone(),
            name: name.clone(),
        })
    }

    async fn work(self: Arc<Self>, cancel: CancellationToken) {
        while let Some((key, waited)) = self.queue.next().await {
            // A kind whose caches have not listed yet (say its CRD is missing on the hub) must not
            // park the worker: its key comes back later and other kinds keep flowing.
            if !self.is_listed(key.rule) {
                lock(&self.deferred).insert(key.clone());
                self.queue.done(&key);
                // The caches may have listed between the check and the insert.
                if self.is_listed(key.rule) {
                    self.release_deferred();
                }
                continue;
            }
            // A standby (or a withdrawn cell) holds its keys until it may write: the queue keeps
            // the latest state per key, so a takeover starts from warm caches without a relist.
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.wait_writable() => {}
            }
            // While the hub is away, wait for it (or for shutdown) instead of failing every key.
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.hub_health.wait_up() => {}
            }
            let state = &self.rules[key.rule];
            self.metrics
                .queue_wait
                .get_or_create(&state.labels)
                .observe(waited.as_secs_f64());
            let span = tracing::info_span!(
                "sync",
                cluster = "cell",
                location = %self.settings.location,
                kind = %state.rule.resource.kind,
                namespace = %key.namespace,
                name = %key.name
            );
            // A bug must cost one key, not a worker: a panic is logged and counted, and the key
            // is retried like any failure.
            let pass = std::panic::AssertUnwindSafe(self.process(&key).instrument(span.clone()));
            let started = Instant::now();
            let outcome = futures::FutureExt::catch_unwind(pass).await;
            self.metrics
                .sync_duration
                .get_or_create(&state.labels)
                .observe(started.elapsed().as_secs_f64());
            match outcome {
                Ok(Ok(())) => {
                    lock(&self.attempts).remove(&key);
                    lock(&self.reported).remove(&key);
                }
                Ok(Err(err)) => self.handle_error(&key, &err, &span).instrument(span.clone()).await,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(parent: &span, panic = %what, "sync pass panicked; retrying the key");
                    self.count_error(state, ErrorClass::Transient);
                    self.queue.add_after(key.clone(), Duration::from_secs(30));
                }
            }
            self.queue.done(&key);
        }
    }

    async fn handle_error(&self, key: &Key, err: &Error, span: &tracing::Span) {
        let state = &self.rules[key.rule];
        let class = err.class();
        self.count_error(state, class);
        if let Error::Hub(e) = err {
            self.hub_health.report_write(e);
        }
        let attempt = {
            let mut attempts = lock(&self.attempts);
            let n = attempts.entry(key.clone()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let retry = class.retry_after(attempt);
        tracing::warn!(parent: span, error = %err, class = class.metric_label(), attempt, retry_in = ?retry, "sync failed");
        if matches!(
            class,
            ErrorClass::Forbidden
                | ErrorClass::Invalid
                | ErrorClass::NamespaceMissing
                | ErrorClass::NotOurs
                | ErrorClass::SourceInvalid
        ) {
            let first = lock(&self.reported).insert(key.clone(), class.event_reason()) != Some(class.event_reason());
            if first {
                self.publish_event(key, EventType::Warning, class.event_reason(), &err.to_string())
                    .await;
            }
        }
        match retry {
            Some(delay) => self.queue.add_after(key.clone(), delay),
            None => {
                lock(&self.first_seen).remove(key);
            }
        }
    }

    fn count_error(&self, state: &RuleState, class: ErrorClass) {
        self.metrics
            .errors
            .get_or_create(&ErrorLabels {
                kind: state.labels.kind.clone(),
                location: state.labels.location.clone(),
                class: class.metric_label(),
            })
            .inc();
    }

    /// Publishes an Event on the source object in the cell; failures are logged, never fatal.
    async fn publish_event(&self, key: &Key, type_: EventType, reason: &str, note: &str) {
        let state = &self.rules[key.rule];
        let Some(source) = state.sources.get(&cache::key(&key.namespace, &key.name)) else {
            return;
        };
        let reference = ObjectReference {
            api_version: Some(state.resource.api_version.clone()),
            kind: Some(state.resource.kind.clone()),
            namespace: source.namespace().map(str::to_owned),
            name: Some(source.name().to_owned()),
            uid: source.uid().map(str::to_owned),
            resource_version: source.resource_version().map(str::to_owned),
            field_path: None,
        };
        // Event notes are limited to 1 kB; cut on a character boundary (notes quote source data).
        let note: String = note
            .chars()
            .scan(0, |bytes, c| {
                *bytes += c.len_utf8();
                (*bytes <= 1000).then_some(c)
            })
            .collect();
        let event = KubeEvent {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Mirror".into(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &reference).await {
            tracing::debug!(error = %err, "failed to publish event");
        }
    }

    fn write_done(&self, key: &Key, op: WriteOp) {
        let state = &self.rules[key.rule];
        self.metrics
            .writes
            .get_or_create(&WriteLabels {
                kind: state.labels.kind.clone(),
                location: state.labels.location.clone(),
                op,
            })
            .inc();
        let seen = lock(&self.first_seen).remove(key);
        if op != WriteOp::skipped
            && let Some(seen) = seen
        {
            self.metrics
                .propagation_lag
                .get_or_create(&state.labels)
                .observe(seen.elapsed().as_secs_f64());
        }
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        self.metrics.last_sync.get_or_create(&state.labels).set(now);
    }

    /// One pass over one key: make the hub copy match the source (or withdraw it).
    async fn process(&self, key: &Key) -> Result<(), Error> {
        let state = &self.rules[key.rule];
        let location = &self.settings.location;
        let copy_name = copy::copy_name(&key.namespace, &key.name, location);
        let ns_key = (key.namespace.clone(), key.name.clone());
        let Some(source) = state.sources.get(&cache::key(&key.namespace, &key.name)) else {
            if lock(&state.tombstones).contains(&ns_key) {
                let deleted = self.withdraw(state, &key.namespace, &copy_name).await?;
                lock(&state.tombstones).remove(&ns_key);
                self.set_unroutable(state, key, false);
                if deleted {
                    self.write_done(key, WriteOp::delete);
                } else {
                    lock(&self.first_seen).remove(key);
                }
            } else {
                // Absent without a watched delete: the sweep decides (it confirms with the cell).
                lock(&self.first_seen).remove(key);
            }
            return Ok(());
        };
        let ns_labels = self
            .namespaces
            .get(&ObjectRef::new(&key.namespace))
            .map(|ns| ns.labels().clone());
        let routing = match routing::resolve(&key.namespace, ns_labels.as_ref()) {
            Ok(routing) => {
                self.set_unroutable(state, key, false);
                routing
            }
            Err(unroutable) => {
                // A copy published under the old routing must not stay: Karmada would go on
                // delivering it to the old project. Before withdrawing it, confirm with a read of
                // the cell (as the sweep does before deleting): a cache behind the cell must not
                // withdraw anything.
                let has_copy = state.copies.get(&cache::key(&key.namespace, &copy_name)).is_some();
                let confirmed = if has_copy {
                    match self.read_routing(&key.namespace).await? {
                        Ok(routing) => Some(routing),
                        Err(confirmed) => {
                            self.withdraw_unroutable(state, key, &copy_name, &confirmed).await?;
                            None
                        }
                    }
                } else {
                    None
                };
                match confirmed {
                    Some(routing) => routing,
                    None => {
                        if self.set_unroutable(state, key, true) {
                            tracing::warn!(reason = %unroutable, "source not published: namespace is not routable");
                            self.publish_event(
                                key,
                                EventType::Warning,
                                "Unroutable",
                                &format!("not published to the hub: {unroutable}"),
                            )
                            .await;
                        }
                        lock(&self.first_seen).remove(key);
                        return Ok(());
                    }
                }
            }
        };
        let source = source.object().map_err(|e| Error::Cache {
            what: "source",
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            source: e,
        })?;
        match copy::plan(&state.rule, location, &source, &routing)? {
            Plan::Ignore | Plan::Hold => {
                lock(&self.first_seen).remove(key);
                Ok(())
            }
            Plan::Withdraw => {
                if self.withdraw(state, &key.namespace, &copy_name).await? {
                    self.write_done(key, WriteOp::delete);
                }
                Ok(())
            }
            Plan::Publish(mut desired) => {
                // The copy watch starts only once the cell is identified, so a listed key has it.
                let Some(cell) = self.cell_id() else {
                    return Err(Error::CellUnidentified);
                };
                copy::mark_cell(&mut desired, cell);
                let api = Api::<DynamicObject>::namespaced_with(self.hub.clone(), &key.namespace, &state.resource);
                // The copy as our cache has it; a copy missing from it is almost always one to
                // create, but the name may be taken by an object that is not ours (another
                // location's copy, a hand-made object), which a forced apply would take over, or
                // be our copy the cache has not listed yet (a restart), which may need no write.
                // So read it first, from the apiserver's watch cache (`resourceVersion=0`): no
                // etcd round trip for the hub (issue #5). A name taken in the instant between
                // this read and the apply is not caught; nor would it be by a quorum read.
                let existing = match state.copies.get(&cache::key(&key.namespace, &copy_name)) {
                    Some(copy) => Some(copy.object().map_err(|e| Error::Cache {
                        what: "copy",
                        namespace: key.namespace.clone(),
                        name: copy_name.clone(),
                        source: e,
                    })?),
                    None => match api.get_with(&copy_name, &GetParams::any()).await {
                        Ok(copy) => Some(copy),
                        Err(kube::Error::Api(s)) if s.code == 404 => None,
                        Err(e) => return Err(Error::Hub(e)),
                    },
                };
                if let Some(copy) = &existing {
                    if !copy::published_by(copy, location) {
                        return Err(self.not_ours(key, &copy_name, copy));
                    }
                    if let Some(other) = copy::publishing_cell(copy).filter(|c| *c != cell) {
                        return Err(Error::OtherCell {
                            namespace: key.namespace.clone(),
                            name: copy_name,
                            cell: other.to_owned(),
                        });
                    }
                    if copy::in_sync(&desired, copy) {
                        self.write_done(key, WriteOp::skipped);
                        return Ok(());
                    }
                }
                let writing = Writing::begin(self, key, copy_name.clone());
                let replaced = self.apply_copy(&api, &writing.id, &desired, existing.as_ref()).await?;
                drop(writing);
                self.write_done(
                    key,
                    match (replaced, existing.is_some()) {
                        (true, _) => WriteOp::replace,
                        (false, true) => WriteOp::update,
                        (false, false) => WriteOp::create,
                    },
                );
                tracing::debug!(copy = %copy_name, "copy applied");
                Ok(())
            }
        }
    }

    /// Server-side applies `desired` to copy `id` (and its status, when the carried status
    /// differs from `existing`'s), recording each write's resourceVersion as an awaited echo.
    /// A copy the apiserver refuses to change because an immutable field differs
    /// ([`is_immutable_change`]) is replaced: deleted with the UID of `existing`, then created.
    /// Returns whether it was replaced.
    async fn apply_copy(
        &self,
        api: &Api<DynamicObject>,
        id: &CopyId,
        desired: &copy::Desired,
        existing: Option<&DynamicObject>,
    ) -> Result<bool, Error> {
        let params = PatchParams::apply(&self.field_manager).force();
        let mut replaced = false;
        let applied = match api.patch(&desired.name, &params, &Patch::Apply(&desired.object)).await {
            Ok(applied) => applied,
            Err(kube::Error::Api(status)) if is_immutable_change(&status) && existing.is_some() => {
                // The source was re-created with another value of an immutable field (a slice's
                // addressType) while nothing watched: no apply can ever bring the copy along.
                // Replace it: delete exactly the copy read (UID precondition), then create.
                let uid = existing.and_then(ResourceExt::uid);
                tracing::info!(copy = %desired.name, reason = %status.message, "replacing the copy: an immutable field differs from its source");
                self.delete_uid(api, &desired.name, uid).await?;
                replaced = true;
                api.patch(&desired.name, &params, &Patch::Apply(&desired.object))
                    .await
                    .map_err(Error::Hub)?
            }
            Err(e) => return Err(Error::Hub(e)),
        };
        lock(&self.echoes).wrote(id, applied.resource_version());
        // A change that leaves the carried status as the copy has it (a label, a spec field)
        // needs no status write.
        let status_current = copy::status_in_sync(desired, existing);
        if let Some(status) = desired.status.as_ref().filter(|_| !status_current) {
            let applied = api
                .patch_status(&desired.name, &params, &Patch::Apply(status))
                .await
                .map_err(Error::Hub)?;
            lock(&self.echoes).wrote(id, applied.resource_version());
        }
        Ok(replaced)
    }

    /// The error for hub object `existing`, named like the copy of `key`, that is not this
    /// location's copy; when it is another location's copy (`web-us`@`east` and `web`@`us-east`
    /// both map to `web-us-east`), the message names that copy's source and location too.
    fn not_ours(&self, key: &Key, name: &str, existing: &DynamicObject) -> Error {
        let annotations = existing.annotations();
        let holder = match (
            existing.labels().get(rules::LOCATION_LABEL),
            annotations.get(copy::SOURCE_NAMESPACE_ANNOTATION),
            annotations.get(copy::SOURCE_NAME_ANNOTATION),
        ) {
            (Some(location), Some(namespace), Some(source)) => {
                format!("the copy of source {namespace}/{source} of location {location}")
            }
            (Some(location), _, _) => format!("a copy of location {location}"),
            _ => "an object the replicator did not publish".to_owned(),
        };
        Error::NotOurs {
            namespace: key.namespace.clone(),
            name: name.to_owned(),
            label: rules::LOCATION_LABEL,
            location: self.settings.location.clone(),
            source_key: format!("{}/{}", key.namespace, key.name),
            holder,
        }
    }

    /// Deletes this location's copy `namespace/name` if it exists (UID precondition). Returns
    /// whether a delete was sent. A same-named object without our label is never touched.
    ///
    /// The copy in the hub cache (selected by our label) names the UID to delete without a read;
    /// only when the cache has none, or its UID is stale (409), is the copy read first.
    pub async fn withdraw(&self, state: &RuleState, namespace: &str, name: &str) -> Result<bool, Error> {
        let api = Api::<DynamicObject>::namespaced_with(self.hub.clone(), namespace, &state.resource);
        let cached = state
            .copies
            .get(&cache::key(namespace, name))
            .and_then(|copy| copy.object().ok())
            .filter(|copy| self.ours(copy));
        if let Some(copy) = cached {
            match self.delete_uid(&api, name, copy.uid()).await? {
                Some(deleted) => return Ok(deleted),
                None => tracing::debug!(copy = %name, "cached UID is stale; reading the copy"),
            }
        }
        // A quorum read (metadata is enough: the delete is conditional on the UID read). Not the
        // watch cache: this path runs when our cache is behind, and a cache as far behind would
        // name the same stale UID, or miss a copy just created, and leave the copy in place.
        let Some(copy) = api.get_metadata_opt(name).await.map_err(Error::Hub)? else {
            return Ok(false);
        };
        if !self.ours(&copy) {
            tracing::warn!(copy = %name, "not withdrawing: the hub object is not this location's copy from this cell");
            return Ok(false);
        }
        Ok(self.delete_uid(&api, name, copy.uid()).await?.unwrap_or(false))
    }

    /// Deletes `name` if its UID is `uid`: `Some(true)` deleted, `Some(false)` already gone,
    /// `None` the UID did not match (409).
    async fn delete_uid(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        uid: Option<String>,
    ) -> Result<Option<bool>, Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(Some(true)),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Some(false)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(Error::Hub(e)),
        }
    }

    /// The routing of `namespace` as the cell has it now: a consistent LIST of that one
    /// namespace (the role's `list`, no `get` needed), not the cache.
    ///
    /// # Errors
    /// [`Error::Cell`] when the cell cannot be read; the caller keeps the copy.
    async fn read_routing(&self, namespace: &str) -> Result<Result<routing::Routing, routing::Unroutable>, Error> {
        let api = Api::<Namespace>::all(self.cell.clone());
        let params = ListParams::default().fields(&format!("metadata.name={namespace}"));
        let listed = api.list_metadata(&params).await.map_err(Error::Cell)?;
        let labels = listed.items.first().map(|ns| ns.labels().clone());
        Ok(routing::resolve(namespace, labels.as_ref()))
    }

    /// Withdraws the copy of `key` because its namespace is no longer routable (`why`, confirmed
    /// with the cell): the copy is deleted (UID precondition), the source gets a `Withdrawn`
    /// Event and the delete is counted as a write.
    async fn withdraw_unroutable(
        &self,
        state: &RuleState,
        key: &Key,
        copy_name: &str,
        why: &routing::Unroutable,
    ) -> Result<(), Error> {
        if self.withdraw(state, &key.namespace, copy_name).await? {
            tracing::warn!(copy = %copy_name, reason = %why, "copy withdrawn: its namespace is no longer routable");
            self.publish_event(
                key,
                EventType::Warning,
                "Withdrawn",
                &format!("copy {}/{copy_name} withdrawn from the hub: {why}", key.namespace),
            )
            .await;
            self.write_done(key, WriteOp::delete);
        }
        Ok(())
    }

    /// Records whether `key` is unroutable; returns true when it just became unroutable.
    fn set_unroutable(&self, state: &RuleState, key: &Key, unroutable: bool) -> bool {
        let mut set = lock(&state.unroutable);
        let id = (key.namespace.clone(), key.name.clone());
        let changed = if unroutable { set.insert(id) } else { set.remove(&id) };
        if changed {
            self.metrics
                .unroutable
                .get_or_create(&state.labels)
                .set(set.len() as i64);
        }
        changed && unroutable
    }

    /// Records whether this replica leads its location (`replicator_leader` and the write gate).
    pub fn set_leader(&self, leader: bool) {
        self.metrics
            .leader
            .get_or_create(&LocationLabels {
                location: self.settings.location.clone(),
            })
            .set(i64::from(leader));
        self.gate
            .send_if_modified(|g| std::mem::replace(&mut g.leading, leader) != leader);
    }

    /// Records whether the cell's copies are withdrawn (writes stay closed while they are).
    pub fn set_withdrawn(&self, withdrawn: bool) {
        self.gate
            .send_if_modified(|g| std::mem::replace(&mut g.withdrawn, withdrawn) != withdrawn);
    }

    /// The current write gate.
    pub fn gate(&self) -> WriteGate {
        *self.gate.borrow()
    }

    /// Whether writes may go out now.
    pub fn writable(&self) -> bool {
        self.gate().open()
    }

    /// A receiver of write-gate changes.
    pub fn subscribe_gate(&self) -> watch::Receiver<WriteGate> {
        self.gate.subscribe()
    }

    /// Resolves once writes may go out (immediately if they may).
    pub async fn wait_writable(&self) {
        let mut rx = self.gate.subscribe();
        // The sender lives in `self`, so the channel cannot close while this runs.
        let _ = rx.wait_for(|g| g.open()).await;
    }

    /// Queues every source in the cell cache, of every rule (after a withdrawal ends: each
    /// source's copy is written back).
    pub fn requeue_sources(&self) -> usize {
        let mut n = 0;
        for (i, state) in self.rules.iter().enumerate() {
            for source in state.sources.state() {
                self.queue.add(Key {
                    rule: i,
                    namespace: source.namespace().unwrap_or_default().to_owned(),
                    name: source.name().to_owned(),
                });
                n += 1;
            }
        }
        n
    }

    /// Queue length, for diagnostics.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Labels of the copies of rule `i`, as shown in logs.
    pub fn describe(&self) -> BTreeMap<String, usize> {
        self.rules
            .iter()
            .map(|r| (r.rule.resource.kind.clone(), r.copies.len()))
            .collect()
    }
}
