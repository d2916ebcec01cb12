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
    api::DynamicObject,
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

/// What the sweep makes of one hub copy from the caches alone (pure; see [`examine`]).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Examined {
    /// Another location's copy, or one of this location published by another cell: never ours
    /// to collect.
    NotOurs,
    /// Ours, but without the source annotations: left alone (nothing says what its source is).
    NoSource,
    /// Its source is in the cell cache: kept.
    SourceCached,
    /// Its source `namespace/name` is missing from the cache: confirm with a read of the cell.
    Confirm {
        /// The source's namespace.
        namespace: String,
        /// The source's name.
        name: String,
    },
}

/// Examines hub copy `copy`: `ours` whether it is this location's copy from this cell,
/// `source_cached(namespace, name)` whether the cell cache holds a source.
fn examine(copy: &DynamicObject, ours: bool, source_cached: impl Fn(&str, &str) -> bool) -> Examined {
    if !ours {
        return Examined::NotOurs;
    }
    let annotations = copy.annotations();
    let (Some(namespace), Some(name)) = (
        annotations.get(copy::SOURCE_NAMESPACE_ANNOTATION),
        annotations.get(copy::SOURCE_NAME_ANNOTATION),
    ) else {
        return Examined::NoSource;
    };
    if source_cached(namespace, name) {
        return Examined::SourceCached;
    }
    Examined::Confirm {
        namespace: namespace.clone(),
        name: name.clone(),
    }
}

/// Whether a copy whose source the cache misses is collected, given the cell's answer to the
/// confirming read of the source: kept while the object read is still a source
/// ([`still_a_source`]); collected when it is gone or no longer a source.
fn collect(state: &RuleState, read: Option<&DynamicObject>) -> bool {
    !read.is_some_and(|source| still_a_source(state, source))
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
        let examined = examine(&copy, sync.ours(&copy), |namespace, name| {
            state.sources.get(&crate::cache::key(namespace, name)).is_some()
        });
        if examined == Examined::NotOurs {
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
        let (namespace, name) = match examined {
            Examined::NotOurs | Examined::SourceCached => continue,
            Examined::NoSource => {
                tracing::warn!(parent: &copy_span, "copy lacks source annotations; left alone");
                continue;
            }
            Examined::Confirm { namespace, name } => (namespace, name),
        };
        let cell_api = Api::<DynamicObject>::namespaced_with(sync.cell().clone(), &namespace, &state.resource);
        match cell_api.get_opt(&name).await {
            Ok(read) if !collect(state, read.as_ref()) => continue,
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
        match sync.delete_copy(state, &namespace, &copy.name_any(), copy.uid()).await {
            Ok(Some(true)) => {
                report.deleted += 1;
                metrics.sweep_deleted.get_or_create(&state.labels).inc();
                tracing::info!(parent: &copy_span, source = %format!("{namespace}/{name}"), "sweep collected a copy whose source is gone");
            }
            // Already gone (404), or replaced since the cache saw it (409: another UID).
            Ok(_) => {}
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

#[cfg(test)]
mod tests {
    //! The sweep's decisions that need no cell or hub: which rules a pass may sweep (a cell
    //! watch not listed, or failing within the last minute, and hub copies not listed, are
    //! skipped), which copies it may even look at (none until the cell is identified), and
    //! when an object read from the cell is still a source. The clients answer every request
    //! with 500 and count them, so a pass that must send nothing is seen to send nothing.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use kube::runtime::{reflector::store::Writer, watcher};
    use prometheus_client::registry::Registry;
    use serde_json::json;

    use super::*;
    use crate::{
        cluster::HubHealth,
        health::Health,
        rules::{Rule, default_rules},
        sync::{self, unix_now},
    };

    /// A client whose every request fails with 500, counted in the returned counter.
    fn counting_client() -> (kube::Client, Arc<AtomicUsize>) {
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&sent);
        let service = tower::service_fn(move |_request: http::Request<kube::client::Body>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async {
                let body = kube::client::Body::from(
                    br#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":500}"#.to_vec(),
                );
                Ok::<_, std::convert::Infallible>(http::Response::builder().status(500).body(body).unwrap())
            }
        });
        (kube::Client::new(service, "default"), sent)
    }

    /// A sync of location `dfw` over `rules`, leading, with counting cell and hub clients.
    struct Fixture {
        sync: Arc<CellSync>,
        metrics: Metrics,
        cell_requests: Arc<AtomicUsize>,
        hub_requests: Arc<AtomicUsize>,
    }

    impl Fixture {
        fn new(rules: Vec<Rule>) -> Fixture {
            let (cell, cell_requests) = counting_client();
            let (hub, hub_requests) = counting_client();
            let metrics = Metrics::register(&mut Registry::default());
            let (sync, _writers) = CellSync::new(
                sync::Settings {
                    location: "dfw".into(),
                    workers: 1,
                    echo_bookkeeping: true,
                },
                rules,
                cell,
                hub,
                HubHealth::new(),
                metrics.clone(),
                Health::default(),
            );
            sync.set_leader(true);
            Fixture {
                sync,
                metrics,
                cell_requests,
                hub_requests,
            }
        }

        /// Marks every rule's caches: the cell watch `listed` and `healthy` with its last error
        /// `error_age` ago (none when `None`), and the hub copies `copies_listed`.
        fn caches(&self, listed: bool, healthy: bool, error_age: Option<u64>, copies_listed: bool) {
            for state in &self.sync.rules {
                state.sources_listed.store(listed, Ordering::Release);
                state.sources_healthy.store(healthy, Ordering::Release);
                let last = error_age.map_or(0, |age| unix_now().saturating_sub(age));
                state.sources_last_error.store(last, Ordering::Release);
                state.copies_listed.store(copies_listed, Ordering::Release);
            }
        }

        async fn sweep(&self) -> Report {
            let settings = Settings {
                interval: Duration::from_secs(600),
                max_deletes: 2,
            };
            sweep_once(&self.sync, &self.metrics, settings).await
        }

        fn requests(&self) -> (usize, usize) {
            (
                self.cell_requests.load(Ordering::SeqCst),
                self.hub_requests.load(Ordering::SeqCst),
            )
        }
    }

    fn kinds(rules: &[Rule]) -> Vec<String> {
        rules.iter().map(|r| r.resource.kind.clone()).collect()
    }

    /// A hub copy of this location of Network `ns/name` (an orphan: no source in the cache).
    fn network_copy(ns: &str, name: &str, location: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "Network",
            "metadata": {
                "name": format!("{name}-{location}"),
                "namespace": ns,
                "uid": "0b8f7e4e-1c5a-4a8e-9b0e-000000000001",
                "labels": {crate::rules::LOCATION_LABEL: location},
                "annotations": {
                    copy::SOURCE_NAMESPACE_ANNOTATION: ns,
                    copy::SOURCE_NAME_ANNOTATION: name,
                    copy::CELL_ANNOTATION: "cell-uid"
                }
            },
            "spec": {"mtu": 1460}
        }))
        .unwrap()
    }

    fn object(labels: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "Network",
            "metadata": {"name": "web", "namespace": "demo", "labels": labels}
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn a_cell_watch_that_never_listed_is_not_swept_and_nothing_is_sent() {
        let f = Fixture::new(default_rules());
        f.caches(false, false, None, true);
        let report = f.sweep().await;
        assert_eq!(report.skipped_rules, kinds(&default_rules()));
        assert_eq!((report.examined, report.deleted, report.kept_on_error), (0, 0, 0));
        assert!(!report.capped && !report.interrupted);
        assert_eq!(f.requests(), (0, 0), "a skipped rule sends nothing");
    }

    #[tokio::test]
    async fn a_listed_watch_that_failed_within_the_last_minute_is_not_swept() {
        let f = Fixture::new(default_rules());
        for age in [0, 1, 30, TRUST_AFTER_ERROR.as_secs() - 2] {
            f.caches(true, false, Some(age), true);
            let report = f.sweep().await;
            assert_eq!(report.skipped_rules, kinds(&default_rules()), "last error {age} s ago");
        }
        assert_eq!(f.requests(), (0, 0));
    }

    #[tokio::test]
    async fn a_failed_watch_quiet_for_a_minute_is_trusted_again() {
        let f = Fixture::new(default_rules());
        f.caches(true, false, Some(TRUST_AFTER_ERROR.as_secs() + 1), true);
        let report = f.sweep().await;
        assert!(report.skipped_rules.is_empty(), "{:?}", report.skipped_rules);
        // A healthy watch is trusted whatever its last error's age.
        f.caches(true, true, Some(0), true);
        assert!(f.sweep().await.skipped_rules.is_empty());
        assert_eq!(f.requests(), (0, 0), "empty caches: nothing to read or delete");
    }

    #[tokio::test]
    async fn hub_copies_not_yet_listed_are_not_swept() {
        let f = Fixture::new(default_rules());
        f.caches(true, true, None, false);
        let report = f.sweep().await;
        assert_eq!(report.skipped_rules, kinds(&default_rules()));
        assert_eq!(f.requests(), (0, 0));
    }

    #[tokio::test]
    async fn only_the_untrusted_rule_is_skipped() {
        let f = Fixture::new(default_rules());
        f.caches(true, true, None, true);
        let subnets = f.sync.rules.iter().position(|s| s.rule.name == "subnets").unwrap();
        f.sync.rules[subnets].sources_healthy.store(false, Ordering::Release);
        f.sync.rules[subnets]
            .sources_last_error
            .store(unix_now(), Ordering::Release);
        assert_eq!(f.sweep().await.skipped_rules, ["Subnet"]);
    }

    #[tokio::test]
    async fn copies_are_left_alone_until_the_cell_is_identified() {
        // The orphans of this location in the hub cache: without the cell's identity the sweep
        // cannot tell its copies from another cell's, so it neither reads nor deletes.
        let rules: Vec<Rule> = default_rules().into_iter().filter(|r| r.name == "networks").collect();
        let mut f = Fixture::new(rules);
        let mut copies = Writer::<Cached>::new(());
        for name in ["a", "b", "c"] {
            copies.apply_watcher_event(&watcher::Event::Apply(Cached::new(&network_copy("demo", name, "dfw"))));
        }
        Arc::get_mut(&mut f.sync).expect("the sync is not shared yet").rules[0].copies = copies.as_reader();
        f.caches(true, true, None, true);
        let report = f.sweep().await;
        assert_eq!(f.sync.rules[0].copies.state().len(), 3);
        assert_eq!((report.examined, report.deleted, report.kept_on_error), (0, 0, 0));
        assert_eq!(f.requests(), (0, 0));
    }

    fn rule_with_selector(selector: Option<serde_json::Value>) -> Vec<Rule> {
        let mut rule = default_rules().into_iter().find(|r| r.name == "networks").unwrap();
        rule.source_selector = selector.map(|s| serde_json::from_value::<LabelSelector>(s).unwrap());
        vec![rule]
    }

    #[tokio::test]
    async fn without_a_selector_every_object_that_is_not_a_copy_is_a_source() {
        let f = Fixture::new(rule_with_selector(None));
        let state = &f.sync.rules[0];
        assert!(still_a_source(state, &object(json!({}))));
        assert!(still_a_source(state, &object(json!({"app": "web"}))));
        assert!(!still_a_source(
            state,
            &object(json!({crate::rules::LOCATION_LABEL: "sjc"}))
        ));
        assert!(!still_a_source(
            state,
            &object(json!({crate::rules::LOCATION_LABEL: ""}))
        ));
        assert!(!still_a_source(
            state,
            &object(json!({crate::rules::KARMADA_MANAGED_LABEL: "true"}))
        ));
    }

    #[tokio::test]
    async fn with_a_selector_an_object_that_left_it_is_no_longer_a_source() {
        let f = Fixture::new(rule_with_selector(Some(json!({
            "matchLabels": {"galactic.datum.net/tenant-id": "t1"},
            "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["test"]}]
        }))));
        let state = &f.sync.rules[0];
        assert!(still_a_source(
            state,
            &object(json!({"galactic.datum.net/tenant-id": "t1"}))
        ));
        assert!(still_a_source(
            state,
            &object(json!({"galactic.datum.net/tenant-id": "t1", "tier": "prod"}))
        ));
        assert!(!still_a_source(state, &object(json!({}))));
        assert!(!still_a_source(
            state,
            &object(json!({"galactic.datum.net/tenant-id": "t2"}))
        ));
        assert!(!still_a_source(
            state,
            &object(json!({"galactic.datum.net/tenant-id": "t1", "tier": "test"}))
        ));
        // Matching the selector does not make a copy Karmada delivered back into the cell a source.
        assert!(!still_a_source(
            state,
            &object(json!({"galactic.datum.net/tenant-id": "t1", crate::rules::KARMADA_MANAGED_LABEL: "true"}))
        ));
    }

    #[test]
    fn examine_judges_a_copy_from_the_caches() {
        let copy = network_copy("demo", "web", "dfw");
        let cached = |ns: &str, name: &str| (ns, name) == ("demo", "web");
        let missing = |_: &str, _: &str| false;
        assert_eq!(examine(&copy, false, missing), Examined::NotOurs);
        assert_eq!(examine(&copy, true, cached), Examined::SourceCached);
        assert_eq!(
            examine(&copy, true, missing),
            Examined::Confirm {
                namespace: "demo".into(),
                name: "web".into()
            }
        );
        let mut bare = copy.clone();
        bare.metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(copy::SOURCE_NAME_ANNOTATION);
        assert_eq!(examine(&bare, true, missing), Examined::NoSource);
    }

    #[tokio::test]
    async fn a_copy_is_collected_when_the_cell_has_no_source_or_no_longer_a_source() {
        let f = Fixture::new(rule_with_selector(Some(json!({"matchLabels": {"app": "web"}}))));
        let state = &f.sync.rules[0];
        assert!(collect(state, None), "gone from the cell");
        assert!(!collect(state, Some(&object(json!({"app": "web"})))), "still a source");
        assert!(collect(state, Some(&object(json!({"app": "db"})))), "left the selector");
        assert!(
            collect(
                state,
                Some(&object(json!({"app": "web", crate::rules::LOCATION_LABEL: "sjc"})))
            ),
            "a copy, not a source"
        );
    }

    #[tokio::test]
    async fn an_exists_selector_needs_the_key_whatever_its_value() {
        let f = Fixture::new(rule_with_selector(Some(json!({
            "matchExpressions": [{"key": "app", "operator": "Exists"}]
        }))));
        let state = &f.sync.rules[0];
        assert!(still_a_source(state, &object(json!({"app": ""}))));
        assert!(still_a_source(state, &object(json!({"app": "web"}))));
        assert!(!still_a_source(state, &object(json!({"application": "web"}))));
    }
}
