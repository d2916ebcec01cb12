//! The lag recorder: cell writes acknowledged → the copy's event in a hub watch.
//!
//! The load generator reports every acknowledged cell write as an [`Ack`]: the copy it should
//! produce, a sequence number carried in a label the mirror copies ([`super::load::SEQ_LABEL`]),
//! and the instant the cell apiserver answered. A metadata watch on the hub copies (label-selected,
//! one namespace) records every sighting: the copy's sequence number on ADDED/MODIFIED, or its
//! DELETED event. A create or update is propagated when the copy first shows its sequence number
//! or a later one (a later write supersedes an earlier one still queued), or its DELETED event; a
//! delete when the copy's DELETED event arrives (copy names are never reused). Writes and sightings are matched after the
//! fact, so the order in which the two arrive does not matter; a sighting that beats the recorded
//! acknowledgement (both are taken in this process) counts as zero lag.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DynamicObject, PartialObjectMeta};
use kube::discovery::ApiResource;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt as _};
use tokio::sync::watch;

use super::load::SEQ_LABEL;

/// What a cell write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// The source was created.
    Create,
    /// The source's sequence label changed.
    Update,
    /// The source was deleted.
    Delete,
}

impl Op {
    /// Every operation, in report order.
    pub const ALL: [Op; 3] = [Op::Create, Op::Update, Op::Delete];

    /// The operation's name in reports: `create`, `update`, `delete`.
    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Update => "update",
            Op::Delete => "delete",
        }
    }
}

/// One acknowledged cell write.
#[derive(Debug, Clone)]
pub struct Ack {
    /// The churn window it belongs to (an index the caller chooses, e.g. per rate).
    pub window: usize,
    /// The name of the copy it should produce on the hub.
    pub copy: String,
    /// Its sequence number (creates and updates).
    pub seq: u64,
    /// What it did.
    pub op: Op,
    /// When the cell apiserver acknowledged it.
    pub at: Instant,
}

#[derive(Debug, Clone, Copy)]
enum Seen {
    Seq(u64),
    Deleted,
}

#[derive(Default)]
struct Inner {
    acks: Vec<Ack>,
    sightings: HashMap<String, Vec<(Seen, Instant)>>,
    present: HashSet<String>,
    relisting: Option<HashSet<String>>,
    present_target: Option<usize>,
    present_reached: Option<Instant>,
    listed: bool,
}

/// The recorder of one phase (one mirror under test over one load). Cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    inner: Arc<Mutex<Inner>>,
    changes: Arc<watch::Sender<u64>>,
}

/// The lags of one window, and what never arrived.
#[derive(Debug, Clone, Default)]
pub struct WindowLags {
    /// Every resolved lag, sorted.
    pub lags: Vec<Duration>,
    /// Writes whose copy never showed them (before the settle deadline).
    pub missing: usize,
    /// Writes to objects that were created and deleted in the cell before any copy of them
    /// appeared on the hub (a mirror that coalesces skips them; the hub ends as it should).
    pub never_published: usize,
    /// The resolved lags again, by what the cell write did, each sorted.
    pub by_op: HashMap<Op, Vec<Duration>>,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Recorder {
    /// Starts watching the copies of `kinds` in `namespace` on the hub that match
    /// `label_selector`, and returns once the watch has listed. The watch runs until `cancel`.
    ///
    /// # Errors
    /// When the initial list does not complete within `deadline`.
    pub async fn start(
        hub: Client,
        namespace: &str,
        kinds: &[ApiResource],
        label_selector: &str,
        deadline: Duration,
        cancel: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Recorder> {
        let recorder = Recorder {
            inner: Arc::default(),
            changes: Arc::new(watch::Sender::new(0)),
        };
        let mut listed = Vec::new();
        for kind in kinds {
            let api = Api::<PartialObjectMeta<DynamicObject>>::namespaced_with(hub.clone(), namespace, kind);
            let config = watcher::Config::default().labels(label_selector);
            let (tx, rx) = tokio::sync::oneshot::channel();
            listed.push(rx);
            let recorder = recorder.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let mut tx = Some(tx);
                let mut events = std::pin::pin!(watcher::watcher(api, config));
                loop {
                    let event = tokio::select! {
                        () = cancel.cancelled() => return,
                        event = events.next() => event,
                    };
                    let Some(event) = event else { return };
                    let at = Instant::now();
                    match event {
                        Ok(event) => {
                            if recorder.observe(&event, at)
                                && let Some(tx) = tx.take()
                            {
                                let _ = tx.send(());
                            }
                        }
                        Err(error) => tracing::warn!(%error, "hub copy watch failed; retrying"),
                    }
                }
            });
        }
        for rx in listed {
            tokio::time::timeout(deadline, rx)
                .await
                .map_err(|_| anyhow::anyhow!("the hub copy watch did not list within {deadline:?}"))??;
        }
        lock(&recorder.inner).listed = true;
        Ok(recorder)
    }

    /// Records one watch event; returns true on InitDone.
    fn observe(&self, event: &Event<PartialObjectMeta<DynamicObject>>, at: Instant) -> bool {
        let mut inner = lock(&self.inner);
        let mut init_done = false;
        match event {
            Event::Init => inner.relisting = Some(HashSet::new()),
            Event::InitApply(meta) | Event::Apply(meta) => {
                let name = meta.name_any();
                if let Some(seq) = meta.labels().get(SEQ_LABEL).and_then(|s| s.parse().ok()) {
                    inner
                        .sightings
                        .entry(name.clone())
                        .or_default()
                        .push((Seen::Seq(seq), at));
                }
                if matches!(event, Event::InitApply(_)) {
                    inner.relisting.get_or_insert_with(HashSet::new).insert(name);
                } else {
                    inner.present.insert(name);
                }
            }
            Event::InitDone => {
                // Kinds list separately: the union of their relists replaces what was present.
                let relisted = inner.relisting.take().unwrap_or_default();
                inner.present.extend(relisted);
                init_done = true;
            }
            Event::Delete(meta) => {
                let name = meta.name_any();
                inner
                    .sightings
                    .entry(name.clone())
                    .or_default()
                    .push((Seen::Deleted, at));
                inner.present.remove(&name);
            }
        }
        if let Some(target) = inner.present_target
            && inner.present_reached.is_none()
            && inner.present.len() >= target
        {
            inner.present_reached = Some(at);
        }
        drop(inner);
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
        init_done
    }

    /// Records an acknowledged cell write.
    pub fn ack(&self, ack: Ack) {
        lock(&self.inner).acks.push(ack);
    }

    /// How many copies the watch currently sees.
    pub fn present(&self) -> usize {
        lock(&self.inner).present.len()
    }

    /// Waits until at least `count` copies are present; returns the instant of the event that
    /// made it so (not the instant this call noticed).
    ///
    /// # Errors
    /// When `deadline` passes first; the error says how many were seen.
    pub async fn wait_present(&self, count: usize, deadline: Duration) -> anyhow::Result<Instant> {
        {
            let mut inner = lock(&self.inner);
            inner.present_target = Some(count);
            inner.present_reached = None;
            if inner.present.len() >= count {
                inner.present_reached = Some(Instant::now());
            }
        }
        let mut rx = self.changes.subscribe();
        let reached = tokio::time::timeout(deadline, async {
            loop {
                if let Some(at) = lock(&self.inner).present_reached {
                    return at;
                }
                if rx.changed().await.is_err() {
                    // The sender lives in `self`: cannot happen; wait out the deadline.
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        reached.map_err(|_| anyhow::anyhow!("{} of {count} copies present after {deadline:?}", self.present()))
    }

    /// Waits until every write of `window` has shown on the hub, or `deadline` passes; returns
    /// how many are still missing (0: settled). Checks a few times a second (matching is
    /// linear in the writes of the window).
    pub async fn settle(&self, window: usize, deadline: Duration) -> usize {
        let what = format!("every write of window {window} to show on the hub");
        let settled = crate::wait::until(deadline, &what, || {
            let missing = self.lags(window).missing;
            async move { Ok::<_, String>((missing == 0).then_some(())) }
        })
        .await;
        match settled {
            Ok(()) => 0,
            Err(_) => self.lags(window).missing,
        }
    }

    /// The lags of the writes of `window`, matched against every sighting so far.
    pub fn lags(&self, window: usize) -> WindowLags {
        let inner = lock(&self.inner);
        let mut out = WindowLags::default();
        let deleted: std::collections::HashSet<&str> = inner
            .acks
            .iter()
            .filter(|a| a.op == Op::Delete)
            .map(|a| a.copy.as_str())
            .collect();
        for ack in inner.acks.iter().filter(|a| a.window == window) {
            let sightings = inner.sightings.get(&ack.copy).map(Vec::as_slice).unwrap_or_default();
            // A deletion is the last state of a copy (names are never reused): it supersedes
            // every earlier write still queued, as a later sequence number does.
            let hit = sightings.iter().find(|(seen, _)| match (ack.op, seen) {
                (_, Seen::Deleted) => true,
                (Op::Create | Op::Update, Seen::Seq(seq)) => *seq >= ack.seq,
                (Op::Delete, Seen::Seq(_)) => false,
            });
            match hit {
                Some((_, at)) => {
                    let lag = at.saturating_duration_since(ack.at);
                    out.lags.push(lag);
                    out.by_op.entry(ack.op).or_default().push(lag);
                }
                None if sightings.is_empty() && deleted.contains(ack.copy.as_str()) => out.never_published += 1,
                None => out.missing += 1,
            }
        }
        out.lags.sort();
        for lags in out.by_op.values_mut() {
            lags.sort();
        }
        out
    }
}

/// The API resources of the two churned kinds: galactic EndpointSlices and NetworkInterfaces.
pub fn churned_kinds() -> anyhow::Result<[ApiResource; 2]> {
    Ok([
        ApiResource::erase::<EndpointSlice>(&()),
        crate::fixtures::resource("networkinterfaces")?,
    ])
}
