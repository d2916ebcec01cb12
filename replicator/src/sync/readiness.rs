//! Readiness of one cell's mirror: every rule's caches and the namespaces listed; keys of a
//! kind not listed yet are parked and released when it is.

use std::sync::atomic::Ordering;

use super::{CellSync, Key, lock};

impl CellSync {
    /// Queues the keys parked while their kind's caches had not listed, for kinds that have now.
    pub(super) fn release_deferred(&self) {
        let ready: Vec<Key> = {
            let mut deferred = lock(&self.deferred);
            let ready: Vec<Key> = deferred.iter().filter(|k| self.is_listed(k.rule)).cloned().collect();
            for k in &ready {
                deferred.remove(k);
            }
            ready
        };
        for key in ready {
            self.queue.add(key);
        }
    }

    /// Re-evaluates readiness after a cache completed a list.
    ///
    /// The evaluation and the health update happen inside the readiness channel's write lock:
    /// reflectors of several kinds finish their lists concurrently, and a caller that read the
    /// flags before another's list completed must not overwrite the later "ready" verdict with
    /// its stale "pending" one (seen in CI: a process stayed unready with every list done).
    pub(super) fn bump_readiness(&self) {
        let key = format!("cell {}", self.settings.location);
        self.readiness.send_modify(|v| {
            *v = v.wrapping_add(1);
            let problems: Vec<String> = self
                .rules
                .iter()
                .filter(|r| !r.sources_listed.load(Ordering::Acquire) || !r.copies_listed.load(Ordering::Acquire))
                .map(|r| r.rule.resource.kind.clone())
                .collect();
            if problems.is_empty() && self.namespaces_listed.load(Ordering::Acquire) {
                self.health.clear(&key);
            } else {
                self.health
                    .set(&key, format!("initial list pending for {problems:?} or namespaces"));
            }
        });
        self.release_deferred();
    }

    /// Whether the caches a key of `rule` needs have all completed a full list.
    pub fn is_listed(&self, rule: usize) -> bool {
        self.namespaces_listed.load(Ordering::Acquire)
            && self
                .rules
                .get(rule)
                .is_some_and(|r| r.sources_listed.load(Ordering::Acquire) && r.copies_listed.load(Ordering::Acquire))
    }

    /// Whether every rule's caches have completed a full list.
    pub fn all_listed(&self) -> bool {
        (0..self.rules.len()).all(|i| self.is_listed(i))
    }

    /// Resolves once every rule's caches have completed a full list.
    pub async fn wait_listed(&self) {
        let mut rx = self.readiness.subscribe();
        let _ = rx.wait_for(|_| self.all_listed()).await;
    }
}
