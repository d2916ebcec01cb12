//! Whether this replica may write its location's copies: it leads the location, the cell's
//! copies are not withdrawn, and no other cell publishes the location (one cell per location,
//! told by the UID of each cell's `kube-system` namespace recorded on its copies).

use std::{sync::atomic::Ordering, time::Duration};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    ResourceExt,
    api::DynamicObject,
    runtime::{
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::ObjectRef,
    },
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{CellSync, RuleState, lock};
use crate::{cache, copy, metrics::LocationLabels};

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

impl CellSync {
    /// Waits for the namespaces to list, then reads this cell's identity, the UID of its
    /// `kube-system` namespace, from the cache (no request, no extra permission). A cell without
    /// one keeps the replica not ready and is looked at again every 10 s. `None` when cancelled.
    pub(super) async fn identify_cell(&self, cancel: &CancellationToken) -> Option<String> {
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
    pub(super) fn note_foreign(&self, state: &RuleState, copy: &DynamicObject, present: bool) -> bool {
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
    pub(super) async fn update_claim(&self) {
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
    pub(super) async fn publish_hub_event(&self, rule: usize, namespace: &str, name: &str, reason: &str, note: &str) {
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
}
