//! The sweep: collects this location's hub copies whose source is gone (docs/architecture.md).
//!
//! It runs once at start-up, after every reflector of the cell has completed a full list, and
//! then every interval (±10 % jitter), only while this replica may write (it leads its location
//! and the cell is not withdrawn); a replica that becomes leader sweeps at once, since the leader
//! before it may have died between sweeps. Safety rules:
//! - a rule is swept only while its cell watch is listed and healthy (an empty or failing cache
//!   must never look like "every source is gone");
//! - only copies carrying this location's label are considered (the hub cache watches that
//!   label, and each copy's label is checked again), so another location's copies are never
//!   touched; nor are copies of this location that another cell published;
//! - a rule is swept only once its hub copies are listed;
//! - a copy whose source is missing from the cache is confirmed with a direct read of the cell;
//!   a read error keeps the copy;
//! - deletes per pass are capped, and each carries a UID precondition.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use kube::{
    Api, ResourceExt,
    api::{DeleteParams, DynamicObject, Preconditions},
    core::{Selector, SelectorExt},
};
use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::{
    cache::Cached,
    copy,
    metrics::{LocationLabels, Metrics},
    sync::{CellSync, RuleState},
};

/// A source watch that failed is trusted again after this long without another error.
const TRUST_AFTER_ERROR: Duration = Duration::from_secs(60);

/// Sweep settings.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Time between sweeps (jittered ±10 %).
    pub interval: Duration,
    /// Deletes per pass, across rules; the rest waits for the next pass.
    pub max_deletes: usize,
}

/// What one pass did, per rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Copies examined.
    pub examined: usize,
    /// Copies deleted.
    pub deleted: usize,
    /// Rules skipped because their cell watch was not listed or not healthy.
    pub skipped_rules: Vec<String>,
    /// Copies kept because the cell could not be read.
    pub kept_on_error: usize,
    /// Whether the delete cap stopped the pass.
    pub capped: bool,
    /// Whether the pass stopped because this replica stopped leading (or the cell was withdrawn).
    pub interrupted: bool,
}

/// Whether `source` (as read from the cell) is still a source of `state`'s rule.
fn still_a_source(state: &RuleState, source: &DynamicObject) -> bool {
    let labels = source.labels();
    if copy::is_copy(labels) {
        return false;
    }
    match &state.rule.source_selector {
        Some(selector) => Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(labels)),
        None => true,
    }
}

/// One sweep pass over every rule of `sync`.
pub async fn sweep_once(sync: &CellSync, metrics: &Metrics, settings: Settings) -> Report {
    let mut report = Report::default();
    let location = &sync.settings.location;
    for state in &sync.rules {
        let kind = &state.rule.resource.kind;
        let span = tracing::info_span!("sweep", cluster = "hub", location = %location, kind = %kind);
        if !state.sources_trusted(TRUST_AFTER_ERROR) {
            tracing::warn!(parent: &span, "sweep skipped: the cell watch is not listed or not healthy");
            report.skipped_rules.push(kind.clone());
            continue;
        }
        if !state.copies_listed.load(Ordering::Acquire) {
            tracing::warn!(parent: &span, "sweep skipped: the hub copies are not listed yet");
            report.skipped_rules.push(kind.clone());
            continue;
        }
        // The copies come from the hub cache (a watch on this location's label), not a LIST:
        // a sweep at rest costs no request, and a restart's sweep no second copy of every copy
        // in memory (issue #5). A copy the watch has not delivered yet waits for the next pass;
        // one it still shows after its deletion answers 404 to the UID-checked delete.
        let copies = state.copies.state();
        sweep_copies(sync, state, metrics, &settings, &span, copies, &mut report).await;
        if report.interrupted {
            tracing::info!("sweep stopped: this replica no longer writes for its location");
            break;
        }
        if report.capped {
            tracing::warn!(
                max = settings.max_deletes,
                "sweep reached its delete cap; the rest waits for the next pass"
            );
            break;
        }
    }
    report
}

/// Sweeps `copies`, this location's copies of `state`'s kind (see [`sweep_once`]).
async fn sweep_copies(
    sync: &CellSync,
    state: &RuleState,
    metrics: &Metrics,
    settings: &Settings,
    span: &tracing::Span,
    copies: Vec<Arc<Cached>>,
    report: &mut Report,
) {
    // One copy parsed at a time: the cache keeps them as text, and a pass over 5,000 copies
    // must not hold 5,000 parsed objects at once.
    for cached in copies {
        let copy = match cached.object() {
            Ok(copy) => copy,
            Err(err) => {
                tracing::warn!(parent: span, copy = %cached.name(), error = %err, "cached copy unreadable; left alone");
                continue;
            }
        };
        // Another location's copy, or one of this location published by another cell: never ours
        // to collect.
        if !sync.ours(&copy) {
            continue;
        }
        report.examined += 1;
        // Lines about one copy name it: the hub object, in its namespace.
        let copy_span = tracing::info_span!(
            parent: span,
            "copy",
            namespace = %copy.namespace().unwrap_or_default(),
            name = %copy.name_any()
        );
        let annotations = copy.annotations();
        let (Some(namespace), Some(name)) = (
            annotations.get(copy::SOURCE_NAMESPACE_ANNOTATION).cloned(),
            annotations.get(copy::SOURCE_NAME_ANNOTATION).cloned(),
        ) else {
            tracing::warn!(parent: &copy_span, "copy lacks source annotations; left alone");
            continue;
        };
        if state.sources.get(&crate::cache::key(&namespace, &name)).is_some() {
            continue;
        }
        let cell_api = Api::<DynamicObject>::namespaced_with(sync.cell().clone(), &namespace, &state.resource);
        match cell_api.get_opt(&name).await {
            Ok(Some(source)) if still_a_source(state, &source) => continue,
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(parent: &copy_span, source = %format!("{namespace}/{name}"), error = %err, "cell read failed; copy kept");
                report.kept_on_error += 1;
                continue;
            }
        }
        if report.deleted >= settings.max_deletes {
            report.capped = true;
            break;
        }
        if !sync.writable() {
            report.interrupted = true;
            break;
        }
        let copy_api = Api::<DynamicObject>::namespaced_with(sync.hub().clone(), &namespace, &state.resource);
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: copy.uid(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match copy_api.delete(&copy.name_any(), &params).await {
            Ok(_) => {
                report.deleted += 1;
                metrics.sweep_deleted.get_or_create(&state.labels).inc();
                tracing::info!(parent: &copy_span, source = %format!("{namespace}/{name}"), "sweep collected a copy whose source is gone");
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(err) => tracing::warn!(parent: &copy_span, error = %err, "sweep delete failed"),
        }
    }
}

/// Runs the start-up sweep once every cache has listed, then a sweep every interval, each only
/// while writes are open; every time they open again (a new leader) it sweeps at once.
pub async fn run(sync: std::sync::Arc<CellSync>, metrics: Metrics, settings: Settings, cancel: CancellationToken) {
    // The start-up sweep waits for every cache to list, but a kind that never lists (its CRD
    // missing on the hub) must not stop the sweep of the others: sweep_once skips it.
    tokio::select! {
        () = cancel.cancelled() => return,
        () = sync.wait_listed() => {}
        () = tokio::time::sleep(Duration::from_secs(60)) => {}
    }
    let mut gate = sync.subscribe_gate();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = sync.wait_writable() => {}
        }
        let report = sweep_once(&sync, &metrics, settings).await;
        metrics
            .sweep_runs
            .get_or_create(&LocationLabels {
                location: sync.settings.location.clone(),
            })
            .inc();
        tracing::info!(
            examined = report.examined,
            deleted = report.deleted,
            kept_on_error = report.kept_on_error,
            skipped = ?report.skipped_rules,
            capped = report.capped,
            interrupted = report.interrupted,
            "sweep done"
        );
        let jitter = rand::rng().random_range(0.9..1.1);
        let wait = settings.interval.mul_f64(jitter);
        // A closed gate ends the wait: the loop then waits for it to open and sweeps at once.
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
            _ = gate.wait_for(|g| !g.open()) => {}
        }
    }
}
