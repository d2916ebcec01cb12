//! The hub reflectors of `replicator membership`: caches, and the service keys each change
//! queues (an interface reaches the services whose selector matches it, before or after).

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
};

use futures::StreamExt;
use kube::{
    Api, Resource, ResourceExt,
    api::DynamicObject,
    core::SelectorExt,
    runtime::{
        WatchStreamExt,
        reflector::store::Writer,
        watcher::{self, Event},
    },
};
use tokio_util::sync::CancellationToken;

use crate::{api::NetworkService, api_errors::ErrorClass};

use super::{ClassLabels, Controller, Key, lock, selector_of, typed};

impl Controller {
    pub(super) fn key_of(o: &impl ResourceExt) -> Key {
        (o.namespace().unwrap_or_default(), o.name_any())
    }

    pub(super) fn mark_listed(&self, bit: u8) {
        self.listed.send_modify(|v| *v |= bit);
    }

    /// Services in `namespace` whose selector matches `labels`.
    pub(super) fn services_matching(&self, namespace: &str, labels: &BTreeMap<String, String>) -> HashSet<String> {
        self.services
            .state_filter(|s| s.namespace().as_deref() == Some(namespace))
            .iter()
            .filter_map(|s| typed::<NetworkService>(s))
            .filter(|s| selector_of(s).is_ok_and(|sel| sel.matches(labels)))
            .map(|s| s.name_any())
            .collect()
    }

    /// Queues the services an interface reaches now or reached before this change.
    pub(super) fn interface_changed(&self, ni: &DynamicObject, deleted: bool) {
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

    pub(super) async fn watch<K>(
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
    pub(super) fn set_leader(&self, leading: bool) {
        self.metrics.leader.set(i64::from(leading));
        let was = self.leader.send_replace(leading);
        if leading && !was {
            for s in self.services.state() {
                self.queue.add(Controller::key_of(s.as_ref()));
            }
        }
    }
}
