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
