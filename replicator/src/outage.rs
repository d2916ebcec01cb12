//! What happens to a location's copies while its cell is unreachable (issue #6).
//!
//! The default keeps them (nothing is deleted because of an outage), and a cell that
//! cannot be reached is usually still serving. A platform that would rather stop routing to a
//! location nobody can vouch for sets `--withdraw-unreachable-after`: once the cell apiserver has
//! not answered for that long, the leader closes the write gate and deletes every copy of the
//! location (UID preconditions, own label only). When the cell answers again and its watches are
//! trusted, the gate opens and every source is queued, so the copies come back from fresh state.
//!
//! The decision is the pure [`decide`]; [`run`] is the probe loop around it.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{health::Health, metrics::LocationLabels, sync::CellSync};

/// A cell's policy for an unreachable cell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Keep the copies as they are (docs/architecture.md).
    #[default]
    Keep,
    /// Withdraw the copies once the cell has not answered for this long.
    WithdrawAfter(Duration),
}

/// What [`decide`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Leave everything as it is.
    Nothing,
    /// Close the gate (if open) and delete the copies still on the hub.
    Withdraw,
    /// Close the gate only: a standby must not write withdrawn copies back if it takes over.
    Close,
    /// Open the gate again and queue every source.
    Restore,
}

/// What the probe saw, for [`decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    /// How long the cell has not answered (`None`: it answers).
    pub down_for: Option<Duration>,
    /// The copies are withdrawn (the gate's `withdrawn`).
    pub withdrawn: bool,
    /// Every source watch has listed and is trusted again (no recent error).
    pub sources_trusted: bool,
    /// This replica leads the location (only the leader deletes).
    pub leading: bool,
}

/// The unreachable-cell rule: withdraw when the policy says so and the outage has lasted the
/// grace period (the leader deletes, and repeats until the hub holds no copy; a standby only
/// closes its gate); restore once the cell answers and its watches are trusted, so no stale
/// source is written back.
pub fn decide(policy: Policy, seen: Observation) -> Action {
    match (seen.down_for, policy) {
        (None, _) if seen.withdrawn && seen.sources_trusted => Action::Restore,
        (Some(down), Policy::WithdrawAfter(grace)) if down >= grace => {
            if seen.leading {
                Action::Withdraw
            } else {
                Action::Close
            }
        }
        _ => Action::Nothing,
    }
}

/// How often the cell's `/version` is probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(2);

/// A source watch that resumed without any event is trusted after this long without an error
/// (as the sweep does). Usually a watch proves itself sooner: an outage long enough to withdraw
/// ends with a relist (the restarted apiserver answers 410 to the old resource version), and the
/// relist marks the kind healthy at once.
const TRUST_AFTER: Duration = Duration::from_secs(60);

/// Probes the cell of `sync` every [`PROBE_EVERY`] until `cancel`: sets `replicator_cell_up`
/// and a readiness problem while it does not answer, and applies `policy` through [`decide`].
pub async fn run(sync: Arc<CellSync>, policy: Policy, health: Health, cancel: CancellationToken) {
    let location = sync.settings.location.clone();
    let labels = LocationLabels {
        location: location.clone(),
    };
    let problem = format!("cell {location} reachability");
    let metrics = sync.metrics().clone();
    let mut down_since: Option<Instant> = None;
    loop {
        let answered = tokio::select! {
            () = cancel.cancelled() => return,
            answered = tokio::time::timeout(Duration::from_secs(5), sync.cell().apiserver_version()) => {
                matches!(answered, Ok(Ok(_)))
            }
        };
        let now = Instant::now();
        if answered {
            if down_since.take().is_some() {
                tracing::info!(location = %location, "cell apiserver answers again");
            }
            health.clear(&problem);
        } else if down_since.is_none() {
            down_since = Some(now);
            tracing::warn!(location = %location, ?policy, "cell apiserver unreachable");
            health.set(&problem, "cell apiserver unreachable");
        }
        metrics.cell_up.get_or_create(&labels).set(i64::from(answered));
        let gate = sync.gate();
        let seen = Observation {
            down_for: down_since.map(|t| now.duration_since(t)),
            withdrawn: gate.withdrawn,
            sources_trusted: sync.rules.iter().all(|r| r.sources_healthy.load(Ordering::Acquire))
                || sync.rules.iter().all(|r| r.sources_trusted(TRUST_AFTER)),
            leading: gate.leading,
        };
        match decide(policy, seen) {
            Action::Nothing => {}
            Action::Withdraw => {
                if !gate.withdrawn {
                    tracing::warn!(location = %location, down_for = ?seen.down_for, "withdrawing this location's copies: the cell stayed unreachable past the grace period");
                }
                sync.set_withdrawn(true);
                withdraw_all(&sync).await;
            }
            Action::Close => sync.set_withdrawn(true),
            Action::Restore => {
                sync.set_withdrawn(false);
                let queued = sync.requeue_sources();
                tracing::info!(location = %location, sources = queued, "cell back: publishing its copies again");
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(PROBE_EVERY) => {}
        }
    }
}

/// Deletes every copy in the hub cache of `sync` (UID preconditions, own label only); failures
/// are logged and retried on the next probe.
async fn withdraw_all(sync: &CellSync) {
    for state in &sync.rules {
        for copy in state.copies.state() {
            let namespace = copy.namespace().unwrap_or_default().to_owned();
            let name = copy.name().to_owned();
            match sync.withdraw(state, &namespace, &name).await {
                Ok(true) => {
                    sync.metrics().withdrawn.get_or_create(&state.labels).inc();
                }
                Ok(false) => {}
                Err(err) => {
                    tracing::warn!(kind = %state.rule.resource.kind, namespace = %namespace, name = %name, error = %err, "withdrawing a copy failed; retrying on the next probe");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(down_for: Option<u64>, withdrawn: bool, sources_trusted: bool, leading: bool) -> Observation {
        Observation {
            down_for: down_for.map(Duration::from_secs),
            withdrawn,
            sources_trusted,
            leading,
        }
    }

    #[test]
    fn keep_never_withdraws() {
        assert_eq!(
            decide(Policy::Keep, seen(Some(86_400), false, false, true)),
            Action::Nothing
        );
    }

    #[test]
    fn withdraw_waits_for_the_grace_period_and_the_lease() {
        let policy = Policy::WithdrawAfter(Duration::from_secs(60));
        assert_eq!(decide(policy, seen(Some(59), false, false, true)), Action::Nothing);
        assert_eq!(decide(policy, seen(Some(60), false, false, true)), Action::Withdraw);
        assert_eq!(
            decide(policy, seen(Some(600), false, false, false)),
            Action::Close,
            "a standby never deletes, but closes its gate so a takeover writes nothing back"
        );
        assert_eq!(
            decide(policy, seen(Some(61), true, false, true)),
            Action::Withdraw,
            "repeats until the hub holds no copy"
        );
    }

    #[test]
    fn restore_waits_for_trusted_watches() {
        let policy = Policy::WithdrawAfter(Duration::from_secs(60));
        assert_eq!(decide(policy, seen(None, true, false, true)), Action::Nothing);
        assert_eq!(decide(policy, seen(None, true, true, true)), Action::Restore);
        assert_eq!(
            decide(policy, seen(None, true, true, false)),
            Action::Restore,
            "a standby reopens too: it may lead next"
        );
        assert_eq!(
            decide(Policy::Keep, seen(None, true, true, true)),
            Action::Restore,
            "a policy changed to keep still restores"
        );
        assert_eq!(decide(policy, seen(None, false, true, true)), Action::Nothing);
    }
}
