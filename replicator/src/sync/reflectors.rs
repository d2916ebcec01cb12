//! The watch loops: cell sources, this location's hub copies, cell and hub namespaces. A loop
//! only updates its cache and queues keys; no hub write happens in a watch loop.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, atomic::Ordering},
    time::Instant,
};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, ResourceExt,
    api::DynamicObject,
    runtime::{
        WatchStreamExt,
        reflector::store::Writer,
        watcher::{self, Event},
    },
};
use tokio_util::sync::CancellationToken;

use super::{CellSync, Key, LIST_PAGE, lock, unix_now};
use crate::{
    api_errors::ErrorClass,
    cache::{self, Cached},
    copy,
    echo::Seen,
    routing::{UPSTREAM_CLUSTER_LABEL, UPSTREAM_NAMESPACE_LABEL},
    rules,
};

impl CellSync {
    pub(super) fn enqueue(&self, key: Key, observed: Option<Instant>) {
        if let Some(at) = observed {
            lock(&self.first_seen).entry(key.clone()).or_insert(at);
        }
        self.queue.add(key);
    }

    pub(super) async fn watch_sources(
        self: Arc<Self>,
        i: usize,
        mut writer: Writer<Cached>,
        cancel: CancellationToken,
    ) {
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

    pub(super) async fn watch_copies(self: Arc<Self>, i: usize, mut writer: Writer<Cached>, cancel: CancellationToken) {
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

    pub(super) async fn watch_namespaces(self: Arc<Self>, mut writer: Writer<Namespace>, cancel: CancellationToken) {
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
    pub(super) async fn watch_hub_namespaces(self: Arc<Self>, cancel: CancellationToken) {
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
    pub(super) fn requeue_namespace(&self, namespace: &str) {
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
    pub(super) fn needs_pass(&self, rule: usize, copy: &DynamicObject) -> bool {
        if !self.settings.echo_bookkeeping {
            return true;
        }
        let Some(rv) = copy.resource_version() else {
            return true;
        };
        let id = (rule, copy.namespace().unwrap_or_default(), copy.name_any());
        lock(&self.echoes).observe(&id, &rv) == Seen::Change
    }

    pub(super) fn key(&self, rule: usize, o: &DynamicObject) -> Key {
        Key {
            rule,
            namespace: o.namespace().unwrap_or_default(),
            name: o.name_any(),
        }
    }

    pub(super) fn source_key_of_copy(&self, rule: usize, copy: &DynamicObject) -> Option<Key> {
        let annotations = copy.annotations();
        let namespace = annotations.get(copy::SOURCE_NAMESPACE_ANNOTATION)?;
        let name = annotations.get(copy::SOURCE_NAME_ANNOTATION)?;
        Some(Key {
            rule,
            namespace: namespace.clone(),
            name: name.clone(),
        })
    }
}
