//! The membership workers: a key is passed once the caches are listed and this replica leads;
//! a failed pass is retried by class.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;

use crate::api_errors::classify;

use super::{ALL_LISTED, ClassLabels, Controller, RECHECK, lock};

impl Controller {
    pub(super) async fn work(self: Arc<Self>, cancel: CancellationToken) {
        while let Some((key, _)) = self.queue.next().await {
            // Only the leader writes, once the caches are listed; a standby holds the key
            // (others wait queued, deduplicated) until it leads or the process stops.
            let mut listed = self.listed.subscribe();
            let mut leading = self.leader.subscribe();
            let ready = async {
                let _ = listed.wait_for(|v| *v == ALL_LISTED).await;
                let _ = leading.wait_for(|l| *l).await;
            };
            tokio::select! {
                () = cancel.cancelled() => {
                    self.queue.done(&key);
                    return;
                }
                () = ready => {}
            }
            let span = tracing::info_span!(
                "membership",
                cluster = "hub",
                kind = "NetworkService",
                namespace = %key.0,
                name = %key.1
            );
            let result = tracing::Instrument::instrument(self.reconcile(&key), span.clone()).await;
            match result {
                Ok(recheck) => {
                    lock(&self.attempts).remove(&key);
                    self.metrics.passes.inc();
                    if recheck {
                        self.queue.add_after(key.clone(), RECHECK);
                    }
                }
                Err(err) => {
                    let class = classify(&err);
                    self.metrics
                        .errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                    let attempt = {
                        let mut a = lock(&self.attempts);
                        let n = a.entry(key.clone()).or_insert(0);
                        *n = n.saturating_add(1);
                        *n
                    };
                    let delay = class.retry_after(attempt).unwrap_or(Duration::from_secs(30));
                    tracing::warn!(parent: &span, error = %err, class = class.metric_label(), retry_in = ?delay, "service pass failed");
                    self.queue.add_after(key.clone(), delay);
                }
            }
            self.queue.done(&key);
        }
    }
}
