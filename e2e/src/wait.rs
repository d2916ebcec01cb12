//! Polling a condition until it holds or a deadline passes.
//!
//! The tests never sleep to synchronise: they poll an observable condition with a deadline, and
//! when the deadline passes the error names what was awaited and what was last seen.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};

/// The first pause between two checks.
const FIRST_INTERVAL: Duration = Duration::from_millis(50);
/// The longest pause between two checks.
const MAX_INTERVAL: Duration = Duration::from_secs(1);

/// The outcome of one check of a condition, for [`until_observed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check<T> {
    /// The condition holds; polling stops and returns the value.
    Ready(T),
    /// The condition does not hold yet; the text describes what was observed.
    NotYet(String),
    /// The condition can never hold (for example the process under test exited); stop now.
    Abort(String),
}

/// Polls `check` until it returns `Ok(Some(value))`, and returns that value.
///
/// `Ok(None)` and `Err(_)` both mean "not yet": errors are treated as transient (a server that is
/// still starting refuses connections) and their message becomes the last observation. Each
/// individual check is also bounded by the remaining time. On timeout the error is
/// [`Error::Timeout`], naming `what` and the last observation.
pub async fn until<T, E, F, Fut>(deadline: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Option<T>, E>>,
    E: Display,
{
    until_observed(deadline, what, || {
        let pending = check();
        async move {
            pending.await.map(|outcome| match outcome {
                Some(value) => Check::Ready(value),
                None => Check::NotYet("condition not met".to_owned()),
            })
        }
    })
    .await
}

/// Like [`until`], but each check reports what it saw through [`Check`], which makes timeout
/// errors self-explanatory and lets a check give up early with [`Check::Abort`].
pub async fn until_observed<T, E, F, Fut>(deadline: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Check<T>, E>>,
    E: Display,
{
    let start = Instant::now();
    let end = start + deadline;
    let mut interval = FIRST_INTERVAL;
    let mut last = String::from("no check completed");
    loop {
        let remaining = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining, check()).await {
            Ok(Ok(Check::Ready(value))) => return Ok(value),
            Ok(Ok(Check::NotYet(observation))) => last = observation,
            Ok(Ok(Check::Abort(reason))) => {
                return Err(Error::Aborted {
                    what: what.to_owned(),
                    reason,
                });
            }
            Ok(Err(error)) => last = format!("error: {error}"),
            Err(_elapsed) => {
                last = format!("{last} (a further check was still running at the deadline)");
            }
        }
        let now = Instant::now();
        if now >= end {
            return Err(Error::Timeout {
                what: what.to_owned(),
                waited: now.duration_since(start),
                last,
            });
        }
        tokio::time::sleep(interval.min(end - now)).await;
        interval = (interval * 3 / 2).min(MAX_INTERVAL);
    }
}

/// Runs `call` until it succeeds, up to five times (100 ms, doubling, between tries), while it
/// fails to reach the apiserver: a pooled connection the server closed while idle fails the
/// next request ("connection closed before message completed"), and a loaded machine drops
/// some. API errors are returned at once.
pub async fn retrying<T, F, Fut>(mut call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut delay = Duration::from_millis(100);
    for _ in 0..4 {
        match call().await {
            Err(error @ (kube::Error::HyperError(_) | kube::Error::Service(_))) => {
                tracing::warn!(%error, "request failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
    call().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_ready_value() -> anyhow::Result<()> {
        let mut calls = 0;
        let value = until(Duration::from_secs(5), "the third call", || {
            calls += 1;
            let n = calls;
            async move { Ok::<_, String>((n >= 3).then_some(n)) }
        })
        .await?;
        assert_eq!(value, 3);
        Ok(())
    }

    #[tokio::test]
    async fn timeout_names_what_and_last_observation() {
        let result: Result<()> = until_observed(Duration::from_millis(120), "the moon", || async {
            Ok::<_, String>(Check::NotYet("still the sun".to_owned()))
        })
        .await;
        match result {
            Err(Error::Timeout { what, last, .. }) => {
                assert_eq!(what, "the moon");
                assert_eq!(last, "still the sun");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn errors_are_transient_observations() {
        let result: Result<()> = until(Duration::from_millis(80), "a server", || async {
            Err::<Option<()>, _>("connection refused")
        })
        .await;
        match result {
            Err(Error::Timeout { last, .. }) => assert_eq!(last, "error: connection refused"),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn abort_stops_immediately() {
        let result: Result<()> = until_observed(Duration::from_secs(30), "a process", || async {
            Ok::<_, String>(Check::Abort("it exited".to_owned()))
        })
        .await;
        assert!(matches!(result, Err(Error::Aborted { .. })), "{result:?}");
    }

    #[tokio::test]
    async fn a_hanging_check_is_bounded_by_the_deadline() {
        let started = std::time::Instant::now();
        let result: Result<()> = until(Duration::from_millis(100), "a hang", || {
            std::future::pending::<std::result::Result<Option<()>, String>>()
        })
        .await;
        assert!(matches!(result, Err(Error::Timeout { .. })), "{result:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
