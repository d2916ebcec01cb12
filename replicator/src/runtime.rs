//! The runtime pieces every command shares, whatever its flags: the version string, the logging
//! flags and their set-up, the duration parser the flags use, and shutdown on a signal. Commands
//! (`cli`, `membership`, `status`) import them from here; nothing imports the command line.

use std::time::Duration;

use clap::Args;

pub use crate::logging::LogFormat;
use tokio_util::sync::CancellationToken;

/// What `replicator --version` prints after the name: the crate version and the git commit the
/// binary was built from (`unknown` without git), e.g. `0.1.0 (commit 8700ddf1a2b3)`. Set by
/// build.rs; `REPLICATOR_GIT_COMMIT` overrides the commit at build time.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("REPLICATOR_BUILD_COMMIT"),
    ")"
);

/// Logging flags of the long-running subcommands.
#[derive(Clone, Debug, Args)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, value_enum, default_value = "text", env = "REPLICATOR_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Which log lines are written: a level (off, error, warn, info, debug, trace) or filter
    /// directives as RUST_LOG takes them, e.g. `replicator=debug,kube=info`. RUST_LOG sets the
    /// same; this flag wins when both are given. Without either:
    /// `info,kube_runtime=warn,kube_client=warn,kube_client::client::builder=off`.
    #[arg(long, value_name = "LEVEL|DIRECTIVES", value_parser = crate::logging::parse_log_filter)]
    pub log_level: Option<String>,
}

/// Parses a duration as `humantime` does (`90s`, `1m30s`, `10m`, `1h`, `500ms`, `2days`,
/// `1h 30m`), or a bare number of seconds; at most a year.
///
/// # Errors
/// A message naming the accepted forms and what is wrong (an unknown unit, a missing one), or
/// that the duration is longer than a year.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let too_long = || format!("{s:?} is longer than a year");
    let d = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(s.parse().map_err(|_| too_long())?)
    } else {
        humantime::parse_duration(s).map_err(|err| match err {
            humantime::DurationError::NumberOverflow => too_long(),
            other => format!("{s:?} is not a duration like 90s, 1m30s, 10m, 1h or 500ms ({other})"),
        })?
    };
    if d > Duration::from_secs(366 * 24 * 3600) {
        return Err(too_long());
    }
    Ok(d)
}

/// Initialises logging from `args` and `RUST_LOG` (see [`crate::logging`]); an invalid
/// `RUST_LOG` that was not overridden is reported as a warning once logging is up.
///
/// # Errors
/// A subscriber already installed.
pub fn init_logging(args: &LogArgs) -> anyhow::Result<()> {
    let env = std::env::var("RUST_LOG").ok();
    let choice = crate::logging::choose_filter(args.log_level.as_deref(), env.as_deref());
    crate::logging::init(args.log_format, &choice.directives).map_err(anyhow::Error::msg)?;
    if let Some(why) = choice.ignored_env {
        tracing::warn!(filter = %choice.directives, "{why}: using the default filter");
    }
    Ok(())
}

/// Cancels `cancel` on SIGTERM or SIGINT.
pub fn spawn_signal_handler(cancel: CancellationToken) {
    tokio::spawn(async move {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(err) => {
                    tracing::error!(error = %err, "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = terminate => {}
        }
        tracing::info!("shutting down");
        cancel.cancel();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_the_usual_units() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(2 * 86_400)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(
            parse_duration(" 45 "),
            Ok(Duration::from_secs(45)),
            "a bare number is seconds"
        );
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        let unknown = parse_duration("5x").unwrap_err();
        assert!(
            unknown.starts_with("\"5x\" is not a duration like 90s, 1m30s"),
            "{unknown}"
        );
        assert!(unknown.contains("unknown time unit \"x\""), "{unknown}");
        assert!(parse_duration("ten minutes").is_err());
        assert!(parse_duration("").is_err());
        assert_eq!(parse_duration("400d"), Err("\"400d\" is longer than a year".to_owned()));
        assert_eq!(
            parse_duration("99999999999999999999h"),
            Err("\"99999999999999999999h\" is longer than a year".to_owned()),
            "overflow is an error, not a panic"
        );
        assert_eq!(
            parse_duration("99999999999999999999"),
            Err("\"99999999999999999999\" is longer than a year".to_owned())
        );
    }
}
