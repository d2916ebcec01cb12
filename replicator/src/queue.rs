//! A deduplicating, keyed work queue (the client-go workqueue contract).
//!
//! Reflectors add keys; workers take them. A key is queued at most once; a key being processed
//! is never handed to a second worker, and a key added while it is processed is queued again
//! when the worker calls [`WorkQueue::done`], so the latest state always gets one more pass.
//! kube-runtime's `Controller` runner has these semantics but reconciles only objects present in
//! its store (a deleted source would never be seen), so the replicator keeps its own queue.
//!
//! Retries are a delay queue inside it: [`WorkQueue::add_after`] records a due time per key (the
//! earliest, when a key is delayed twice), and the waiting workers sleep until the earliest due
//! time, so no task or timer exists per delayed key; 10,000 keys backing off cost 10,000 map
//! entries and one timer per idle worker.

use std::{
    collections::{BTreeSet, HashMap, HashSet, VecDeque},
    hash::Hash,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use prometheus_client::metrics::gauge::Gauge;
use tokio::{sync::Notify, time::Instant};

/// The queue. Share it behind an [`Arc`](std::sync::Arc).
pub struct WorkQueue<K> {
    state: Mutex<State<K>>,
    notify: Notify,
    /// Set to the number of waiting keys on every change ([`WorkQueue::with_depth`]).
    depth: Option<Gauge>,
}

struct State<K> {
    order: VecDeque<K>,
    /// Waiting keys, with when each was queued (the queue-wait metric).
    queued: HashMap<K, Instant>,
    active: HashSet<K>,
    again: HashSet<K>,
    /// Delayed keys by due time (a sequence number breaks ties), and each one's due time.
    delayed: BTreeSet<(Instant, u64, K)>,
    due: HashMap<K, (Instant, u64)>,
    sequence: u64,
    closed: bool,
}

impl<K: Hash + Eq + Ord + Clone + Send + 'static> Default for WorkQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Hash + Eq + Ord + Clone + Send + 'static> WorkQueue<K> {
    /// An empty, open queue.
    pub fn new() -> Self {
        Self::with_depth_gauge(None)
    }

    /// An empty, open queue that keeps `depth` at its number of waiting keys ([`WorkQueue::len`],
    /// client-go's `workqueue_depth`): keys being processed or waiting out [`WorkQueue::add_after`]
    /// are not counted.
    pub fn with_depth(depth: Gauge) -> Self {
        Self::with_depth_gauge(Some(depth))
    }

    fn with_depth_gauge(depth: Option<Gauge>) -> Self {
        if let Some(gauge) = &depth {
            gauge.set(0);
        }
        Self {
            depth,
            state: Mutex::new(State {
                order: VecDeque::new(),
                queued: HashMap::new(),
                active: HashSet::new(),
                again: HashSet::new(),
                delayed: BTreeSet::new(),
                due: HashMap::new(),
                sequence: 0,
                closed: false,
            }),
            notify: Notify::new(),
        }
    }

    /// Updates the depth gauge; called with the lock held, so the last update is the latest.
    fn report(&self, s: &State<K>) {
        if let Some(gauge) = &self.depth {
            gauge.set(i64::try_from(s.order.len()).unwrap_or(i64::MAX));
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<K>> {
        // A poisoned lock means a worker panicked while holding it; the sets are still
        // consistent (every mutation is a single insert/remove), so keep going.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues `key` unless it is already queued; marks it for another pass if it is active.
    pub fn add(&self, key: K) {
        let mut s = self.lock();
        if self.add_locked(&mut s, key, Instant::now()) {
            drop(s);
            self.notify.notify_one();
        }
    }

    /// [`WorkQueue::add`] with the lock held, the key counted as waiting `since` (the queue-wait
    /// metric); returns whether the key was queued (a worker is to be woken).
    fn add_locked(&self, s: &mut State<K>, key: K, since: Instant) -> bool {
        if s.closed || s.queued.contains_key(&key) {
            return false;
        }
        if s.active.contains(&key) {
            s.again.insert(key);
            return false;
        }
        s.queued.insert(key.clone(), since);
        s.order.push_back(key);
        self.report(s);
        true
    }

    /// Queues `key` once `delay` has passed (per-key backoff), as [`WorkQueue::add`] would then.
    /// A key already delayed keeps the earlier of its due times. Needs no runtime and starts no
    /// task: the due time is recorded and the waiting workers wake for it.
    pub fn add_after(&self, key: K, delay: Duration) {
        let now = Instant::now();
        // A delay past what an Instant holds means "a year": nothing waits that long anyway.
        let at = now
            .checked_add(delay)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
        let mut s = self.lock();
        if s.closed {
            return;
        }
        if let Some(&(due, seq)) = s.due.get(&key) {
            if due <= at {
                return;
            }
            s.delayed.remove(&(due, seq, key.clone()));
        }
        s.sequence = s.sequence.wrapping_add(1);
        let seq = s.sequence;
        s.delayed.insert((at, seq, key.clone()));
        s.due.insert(key, (at, seq));
        drop(s);
        // Every waiting worker recomputes the time it sleeps until.
        self.notify.notify_waiters();
    }

    /// Queues the delayed keys that are due, each counted as waiting since its due time (a key
    /// that fell due while every worker was busy has waited since then); returns the next due
    /// time, if any is left.
    fn promote_due(&self, s: &mut State<K>) -> Option<Instant> {
        let now = Instant::now();
        while let Some((at, _, _)) = s.delayed.first() {
            if *at > now {
                return Some(*at);
            }
            if let Some((at, _, key)) = s.delayed.pop_first() {
                s.due.remove(&key);
                self.add_locked(s, key, at);
            }
        }
        None
    }

    /// Number of keys waiting out [`WorkQueue::add_after`].
    pub fn delayed(&self) -> usize {
        self.lock().delayed.len()
    }

    /// Waits for the next key and marks it active; `None` once the queue is closed and drained.
    /// The duration is how long the key waited in the queue (from the add that queued it, or
    /// from the [`WorkQueue::done`] that queued it again), what client-go's workqueue reports
    /// as queue duration.
    pub async fn next(&self) -> Option<(K, Duration)> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wake_at = {
                let mut s = self.lock();
                let wake_at = self.promote_due(&mut s);
                if let Some(key) = s.order.pop_front() {
                    let waited = s.queued.remove(&key).map(|at| at.elapsed()).unwrap_or_default();
                    s.active.insert(key.clone());
                    self.report(&s);
                    if !s.order.is_empty() {
                        // Let another idle worker pick up the rest.
                        self.notify.notify_one();
                    }
                    return Some((key, waited));
                }
                if s.closed {
                    return None;
                }
                wake_at
            };
            match wake_at {
                Some(at) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(at) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Marks `key` processed; re-queues it if it was added while active.
    pub fn done(&self, key: &K) {
        let mut s = self.lock();
        s.active.remove(key);
        if s.again.remove(key) && !s.closed && !s.queued.contains_key(key) {
            s.queued.insert(key.clone(), Instant::now());
            s.order.push_back(key.clone());
            self.report(&s);
            drop(s);
            self.notify.notify_one();
        }
    }

    /// Number of keys waiting (not counting active ones).
    pub fn len(&self) -> usize {
        self.lock().order.len()
    }

    /// Whether no key is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops accepting keys and wakes every waiting worker; waiting and delayed keys are dropped.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.order.clear();
        s.queued.clear();
        s.delayed.clear();
        s.due.clear();
        self.report(&s);
        drop(s);
        self.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn keys_are_deduplicated_and_fifo() {
        let q = WorkQueue::new();
        q.add("a");
        q.add("b");
        q.add("a");
        assert_eq!(q.len(), 2);
        assert_eq!(q.next().await.map(|(k, _)| k), Some("a"));
        assert_eq!(q.next().await.map(|(k, _)| k), Some("b"));
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn next_reports_how_long_the_key_waited() {
        let q = WorkQueue::new();
        let before = Instant::now();
        q.add("a");
        // Let measurable time pass while the key waits (no synchronisation depends on it).
        while before.elapsed() < Duration::from_millis(5) {
            std::hint::spin_loop();
        }
        let (key, waited) = q.next().await.unwrap();
        assert_eq!(key, "a");
        assert!(waited >= Duration::from_millis(5), "waited {waited:?}");
        assert!(waited <= before.elapsed());
        // A key queued again by `done` waits from then, not from its first add.
        q.add("a");
        let requeued = Instant::now();
        q.done(&"a");
        let (_, waited) = q.next().await.unwrap();
        assert!(waited <= requeued.elapsed());
    }

    #[tokio::test]
    async fn the_depth_gauge_counts_waiting_keys_only() {
        let depth = Gauge::default();
        let q = WorkQueue::with_depth(depth.clone());
        assert_eq!(depth.get(), 0);
        q.add("a");
        q.add("b");
        q.add("a");
        assert_eq!(depth.get(), 2, "a key is queued once");
        let (a, _) = q.next().await.unwrap();
        assert_eq!(depth.get(), 1, "a key being processed is not waiting");
        q.add("a");
        assert_eq!(depth.get(), 1, "re-added while active: queued again only at done");
        q.done(&a);
        assert_eq!(depth.get(), 2);
        q.close();
        assert_eq!(depth.get(), 0, "a closed queue drops its keys");
    }

    #[tokio::test]
    async fn a_key_added_while_active_comes_back_after_done_only() {
        let q = WorkQueue::new();
        q.add("a");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("a"));
        q.add("a");
        assert!(q.is_empty(), "an active key is not handed out twice");
        q.done(&"a");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("a"));
        q.done(&"a");
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_waiting_worker_wakes_on_add_and_close_ends_it() {
        let q = Arc::new(WorkQueue::new());
        let worker = {
            let q = Arc::clone(&q);
            tokio::spawn(async move {
                let mut seen = vec![];
                while let Some((k, _)) = q.next().await {
                    seen.push(k);
                    q.done(&k);
                }
                seen
            })
        };
        tokio::task::yield_now().await;
        q.add(1);
        q.add(2);
        // Wait for the worker to drain, bounded by a deadline rather than a fixed sleep.
        tokio::time::timeout(Duration::from_secs(5), async {
            while !q.is_empty() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap();
        tokio::task::yield_now().await;
        q.close();
        let seen = tokio::time::timeout(Duration::from_secs(5), worker)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(seen, vec![1, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn add_after_delays_the_key_without_a_task() {
        let q = Arc::new(WorkQueue::new());
        q.add_after("k", Duration::from_secs(3));
        assert!(q.is_empty());
        assert_eq!(q.delayed(), 1);
        let started = Instant::now();
        assert_eq!(q.next().await.map(|(k, _)| k), Some("k"));
        assert_eq!(started.elapsed(), Duration::from_secs(3), "woken at the due time");
        assert_eq!(q.delayed(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_delayed_twice_keeps_its_earlier_due_time_and_comes_once() {
        let q = Arc::new(WorkQueue::new());
        let t0 = Instant::now();
        q.add_after("k", Duration::from_secs(10));
        q.add_after("k", Duration::from_secs(2));
        q.add_after("k", Duration::from_secs(5));
        q.add_after("j", Duration::from_secs(4));
        assert_eq!(q.delayed(), 2);
        assert_eq!(q.next().await.map(|(k, _)| k), Some("k"));
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        q.done(&"k");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("j"));
        assert_eq!(t0.elapsed(), Duration::from_secs(4));
        q.done(&"j");
        tokio::time::advance(Duration::from_secs(60)).await;
        let more = tokio::time::timeout(Duration::from_secs(1), q.next()).await;
        assert!(more.is_err(), "nothing else comes: {more:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_worker_wakes_earlier_for_a_nearer_due_time() {
        let q = Arc::new(WorkQueue::new());
        let t0 = Instant::now();
        q.add_after("late", Duration::from_secs(30));
        let worker = {
            let q = Arc::clone(&q);
            tokio::spawn(async move { q.next().await.map(|(k, _)| (k, t0.elapsed())) })
        };
        // The worker is asleep until the late key's due time.
        tokio::time::sleep(Duration::from_secs(1)).await;
        q.add_after("soon", Duration::from_secs(1));
        let got = worker.await.unwrap();
        assert_eq!(got, Some(("soon", Duration::from_secs(2))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_key_due_while_active_comes_back_after_done() {
        let q = Arc::new(WorkQueue::new());
        q.add("k");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("k"));
        q.add_after("k", Duration::from_secs(1));
        tokio::time::advance(Duration::from_secs(2)).await;
        q.add("other");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("other"));
        q.done(&"k");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("k"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_that_fell_due_while_workers_were_busy_has_waited_since_its_due_time() {
        let q = Arc::new(WorkQueue::new());
        q.add("busy");
        assert_eq!(q.next().await.map(|(k, _)| k), Some("busy"));
        q.add_after("k", Duration::from_secs(1));
        // The only worker is busy for 5 s; the key fell due 4 s before it asks again.
        tokio::time::advance(Duration::from_secs(5)).await;
        q.done(&"busy");
        let (key, waited) = q.next().await.unwrap();
        assert_eq!(key, "k");
        assert_eq!(waited, Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn close_drops_delayed_keys() {
        let q = Arc::new(WorkQueue::new());
        q.add_after("k", Duration::from_secs(1));
        q.close();
        assert_eq!(q.delayed(), 0);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(q.next().await, None);
    }
}
