//! The workers: take a key from the queue once writes may go out and the hub is up, run one
//! pass over it, and apply the error policy (retry by class, Events, metrics).

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event as KubeEvent, EventType};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{CellSync, Error, Key, RuleState, lock};
use crate::{
    api_errors::ErrorClass,
    cache,
    metrics::{ErrorLabels, WriteLabels, WriteOp},
};

impl CellSync {
    pub(super) async fn work(self: Arc<Self>, cancel: CancellationToken) {
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

    pub(super) async fn handle_error(&self, key: &Key, err: &Error, span: &tracing::Span) {
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

    pub(super) fn count_error(&self, state: &RuleState, class: ErrorClass) {
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
    pub(super) async fn publish_event(&self, key: &Key, type_: EventType, reason: &str, note: &str) {
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

    pub(super) fn write_done(&self, key: &Key, op: WriteOp) {
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
}

#[cfg(test)]
mod tests {
    //! The worker's error policy with paused time: when a failed key comes back, per class; the
    //! Event on the source, once per class; the error metric.

    use http::{Method, StatusCode};
    use kube::{api::DynamicObject, runtime::watcher};
    use serde_json::json;

    use super::*;
    use crate::{
        cache::Cached,
        sync::testing::{Handle, answer, fixture},
    };

    fn key() -> Key {
        Key {
            rule: 0,
            namespace: "team".into(),
            name: "web".into(),
        }
    }

    fn api_error(code: u16, reason: &str) -> Error {
        Error::Hub(kube::Error::Api(
            serde_json::from_value(json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "code": code, "reason": reason, "message": "refused",
            }))
            .unwrap(),
        ))
    }

    fn errors(sync: &CellSync, class: &'static str) -> u64 {
        sync.metrics
            .errors
            .get_or_create(&ErrorLabels {
                kind: "Network".into(),
                location: "dfw".into(),
                class,
            })
            .get()
    }

    /// Fails `key` with `err` once (answering the Event it publishes on the cell, if any) and
    /// returns the reason of that Event and how long until the key is handed out again (`None`:
    /// not within an hour).
    async fn fail_once(
        sync: &Arc<CellSync>,
        cell: &mut Handle,
        err: Error,
        events: bool,
    ) -> (Option<String>, Option<Duration>) {
        let failing = {
            let sync = Arc::clone(sync);
            tokio::spawn(async move {
                let span = tracing::Span::none();
                sync.handle_error(&key(), &err, &span).await;
            })
        };
        let reason = if events {
            let (method, uri, _, body) = answer(cell, StatusCode::CREATED, json!({})).await;
            assert_eq!(method, Method::POST);
            assert_eq!(uri, "/apis/events.k8s.io/v1/namespaces/team/events?");
            assert_eq!(body["regarding"]["name"], "web");
            body["reason"].as_str().map(str::to_owned)
        } else {
            None
        };
        failing.await.unwrap();
        sync.queue.done(&key());
        let t0 = tokio::time::Instant::now();
        let back = tokio::time::timeout(Duration::from_secs(3600), sync.queue.next()).await;
        let back = back.ok().flatten().map(|(k, _)| {
            assert_eq!(k, key());
            sync.queue.done(&k);
            t0.elapsed()
        });
        (reason, back)
    }

    fn cache_source(writers: &mut crate::sync::Writers) {
        let source: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "networking.datumapis.com/v1alpha", "kind": "Network",
            "metadata": {"name": "web", "namespace": "team", "uid": "src-1", "resourceVersion": "3"},
        }))
        .unwrap();
        writers.sources[0].apply_watcher_event(&watcher::Event::Apply(Cached::new(&source)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_transient_failure_backs_off_from_250_ms_without_an_event() {
        let (sync, mut writers, mut cell, _hub) = fixture();
        cache_source(&mut writers);
        for want in [250, 500, 1000, 2000] {
            let (event, back) = fail_once(&sync, &mut cell, api_error(500, "InternalError"), false).await;
            assert_eq!((event, back), (None, Some(Duration::from_millis(want))));
        }
        assert_eq!(errors(&sync, "transient"), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_backs_off_from_5_s_and_is_reported_once_per_class() {
        let (sync, mut writers, mut cell, _hub) = fixture();
        cache_source(&mut writers);
        let (event, back) = fail_once(&sync, &mut cell, api_error(403, "Forbidden"), true).await;
        assert_eq!(event.as_deref(), Some("HubWriteForbidden"));
        assert_eq!(back, Some(Duration::from_secs(5)));
        let (event, back) = fail_once(&sync, &mut cell, api_error(403, "Forbidden"), false).await;
        assert_eq!((event, back), (None, Some(Duration::from_secs(10))), "reported once");
        // Another class is another report; the attempts go on counting.
        let (event, back) = fail_once(&sync, &mut cell, api_error(422, "Invalid"), true).await;
        assert_eq!(event.as_deref(), Some("HubRejectedCopy"));
        assert_eq!(back, Some(Duration::from_secs(20)));
        assert_eq!(errors(&sync, "forbidden"), 2);
        assert_eq!(errors(&sync, "invalid"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_backs_off_to_at_most_5_minutes() {
        let (sync, mut writers, mut cell, _hub) = fixture();
        cache_source(&mut writers);
        let mut last = None;
        for attempt in 1..=9 {
            let (_, back) = fail_once(&sync, &mut cell, api_error(403, "Forbidden"), attempt == 1).await;
            last = back;
        }
        assert_eq!(last, Some(Duration::from_secs(300)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_invalid_source_is_not_retried_until_it_changes() {
        let (sync, mut writers, mut cell, _hub) = fixture();
        cache_source(&mut writers);
        lock(&sync.first_seen).insert(key(), Instant::now());
        let err = Error::Source(crate::copy::Error::InvalidLabelValue {
            key: "networking.datumapis.com/held-by".into(),
            value: "-".into(),
        });
        let (event, back) = fail_once(&sync, &mut cell, err, true).await;
        assert_eq!((event.as_deref(), back), (Some("SourceInvalid"), None));
        assert!(!lock(&sync.first_seen).contains_key(&key()), "its lag is not measured");
        assert_eq!(errors(&sync, "source_invalid"), 1);
    }
}
