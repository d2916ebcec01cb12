//! Mirroring of one cell onto the hub: reflectors feed a keyed queue, workers apply copies.
//!
//! ```text
//!  cell sources ─┐                                   ┌─ hub writer ── apply copy (+ status)
//!  cell namespaces ─ reflectors ─ caches + keys ─ queue ─ worker ─ pass ─┤  (echo recorded)
//!  hub copies ───┘  (reflectors.rs)        (queue.rs) (worker.rs) (pass.rs) └─ withdraw (UID precondition)
//!                                                      │
//!                    readiness.rs: caches listed ──────┤  gate.rs: leading, not withdrawn,
//!                                                      └─ no other cell claims the location
//! ```
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
//!
//! The modules: `reflectors` (watch loops), `readiness` (lists done, parked keys), `gate` (may
//! this replica write), `worker` (queue loop, error policy, Events, metrics), `pass` (one key:
//! routing, plan, existing copy), `hub_writer` (the only writes to the hub's copies), `error`.

mod error;
mod gate;
mod hub_writer;
mod pass;
mod readiness;
mod reflectors;
mod step;
#[cfg(test)]
mod testing;
mod worker;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, Mutex, MutexGuard, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Client,
    discovery::ApiResource,
    runtime::{
        events::{Recorder, Reporter},
        reflector::{Store, store::Writer},
    },
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{
    cache::Cached,
    cluster::HubHealth,
    copy,
    echo::Echoes,
    health::Health,
    metrics::{KindLabels, LocationLabels, Metrics},
    queue::WorkQueue,
    rules::Rule,
};

pub use error::Error;
pub use gate::WriteGate;

/// Objects per page of the reflectors' LISTs (kube-runtime's default is 500). A page is held
/// whole while its objects go into the cache, managedFields and all (about 10 KB per object
/// parsed), and a restart lists sources and copies of every kind at once: 500 per page left
/// 20 MB of a 10,000-object restart resident in each process; 100 keeps that to a few MB for
/// 50 LISTs of 100 instead of 10 of 500 (issue #5, measured with `replicator-bench memory`).
pub const LIST_PAGE: u32 = 100;

/// A queued unit of work: one source key of one rule.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
    /// Whether the watch events of our own writes are told apart ([`crate::echo`]) and cost no
    /// pass; `false` gives every copy event a pass (for measuring what the bookkeeping saves).
    pub echo_bookkeeping: bool,
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

/// The reflector writers handed to [`CellSync::run`], one pair per rule plus namespaces.
pub struct Writers {
    sources: Vec<Writer<Cached>>,
    copies: Vec<Writer<Cached>>,
    namespaces: Writer<Namespace>,
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
