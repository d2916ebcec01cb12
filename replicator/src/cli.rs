//! Command-line interface and wiring: `replicator run` and `replicator crds`.

use std::{path::PathBuf, sync::Arc, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::{
    cluster::{self, HubHealth},
    health::Health,
    http,
    metrics::{LocationLabels, Metrics},
    rules, sweep,
    sync::{CellSync, Settings},
};

/// Mirrors network objects from Kubernetes cells onto a Karmada hub.
#[derive(Debug, Parser)]
#[command(name = "replicator", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mirror one cell onto the hub (one deployment per cell).
    Run(RunArgs),
    /// Resolve NetworkService membership on the hub: status and EndpointSlices (run once).
    Membership(crate::membership::MembershipArgs),
    /// Per location and kind: copies, sources, drift, last sync, lag percentiles, leader.
    Status(crate::status::StatusArgs),
    /// Print the project's CRDs as YAML (the content of config/crds/).
    Crds,
    /// Print the Karmada ClusterPropagationPolicies for these locations (policies/policies.yaml).
    Policies {
        /// A location with a cell (repeat for each); each gets a policy carrying its
        /// NetworkContext and Subnet copies to it.
        #[arg(long = "location", required = true)]
        locations: Vec<String>,
    },
}

/// Log output format.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, span fields (cluster, kind, namespace, name) at the top level.
    Json,
}

/// Flags of `replicator run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// This cell's location: the copy name suffix and the value of the location label
    /// (a DNS label, at most 63 characters).
    #[arg(long, env = "REPLICATOR_LOCATION")]
    pub location: String,
    /// Kubeconfig of the cell; the in-cluster service account when absent.
    #[arg(long, env = "REPLICATOR_CELL_KUBECONFIG")]
    pub cell_kubeconfig: Option<PathBuf>,
    /// Kubeconfig of the hub (required). While the file is missing or empty the process waits
    /// and reports not-ready.
    #[arg(long, env = "REPLICATOR_HUB_KUBECONFIG")]
    pub hub_kubeconfig: PathBuf,
    /// Metrics and probe addresses.
    #[command(flatten)]
    pub serve: crate::http::ServeArgs,
    /// Time between sweeps of copies whose source is gone (jittered ±10 %), e.g. 10m, 30s.
    #[arg(long, default_value = "10m", value_parser = parse_sweep_interval)]
    pub sweep_interval: Duration,
    /// Most copies one sweep pass deletes.
    #[arg(long, default_value_t = 1000)]
    pub sweep_max_deletes: usize,
    /// YAML file adding or overriding rules (see README, "Rules").
    #[arg(long, env = "REPLICATOR_RULES")]
    pub rules: Option<PathBuf>,
    /// Concurrent hub writers.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Log format.
    #[arg(long, value_enum, default_value = "text", env = "REPLICATOR_LOG_FORMAT")]
    pub log_format: LogFormat,
}

/// Parses `90s`, `10m`, `1h`, `500ms` or a bare number of seconds.
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s, 10m, 1h or 500ms"))?;
    let too_long = || format!("{s:?} is longer than a year");
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(too_long)?),
        "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(too_long)?),
        _ => return Err(format!("{s:?} is not a duration like 30s, 10m, 1h or 500ms")),
    };
    if d > Duration::from_secs(366 * 24 * 3600) {
        return Err(too_long());
    }
    Ok(d)
}

/// Parses a sweep interval: a duration of at least one second (a sweep lists the hub).
///
/// # Errors
/// As [`parse_duration`], or a message for intervals under a second.
pub fn parse_sweep_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!(
            "--sweep-interval {s:?} must be at least 1s: every sweep lists the hub"
        ));
    }
    Ok(d)
}

/// Installs the tracing subscriber (`RUST_LOG` filters, default `info`).
pub fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_runtime=warn,kube_client=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(crate::logging::FlatJson)
            .init(),
    }
}

/// Runs `replicator run` until SIGTERM or SIGINT.
///
/// # Errors
/// Invalid flags or rules, a cell client that cannot be built, or an unbindable address.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    if !rules::is_dns_label(&args.location) {
        anyhow::bail!(
            "--location {:?} must be a DNS label (lowercase letters, digits, '-', at most 63)",
            args.location
        );
    }
    let rules = rules::load(args.rules.as_deref())?;
    let cancel = CancellationToken::new();
    spawn_signal_handler(cancel.clone());

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::default();
    let location_labels = LocationLabels {
        location: args.location.clone(),
    };
    health.set(
        "hub",
        format!("waiting for hub kubeconfig {}", args.hub_kubeconfig.display()),
    );
    metrics.hub_up.get_or_create(&location_labels).set(0);

    let mut servers = http::spawn(&args.serve, registry, health.clone(), &cancel);

    let cell = cluster::cell_client(args.cell_kubeconfig.as_deref()).await?;
    let hub = cluster::wait_for_hub_client(&args.hub_kubeconfig, Duration::from_secs(2), &cancel, &health).await;
    let Some(hub) = hub else { return Ok(()) };
    health.clear("hub");
    tracing::info!(location = %args.location, rules = rules.len(), "hub kubeconfig loaded; starting");

    let hub_health = HubHealth::new();
    let mut tasks = tokio::task::JoinSet::new();
    {
        let (hub_health, hub, cancel, health, metrics) = (
            hub_health.clone(),
            hub.clone(),
            cancel.clone(),
            health.clone(),
            metrics.clone(),
        );
        let labels = location_labels.clone();
        tasks.spawn(async move {
            hub_health
                .probe(hub, Duration::from_secs(1), cancel, move |up| {
                    metrics.hub_up.get_or_create(&labels).set(i64::from(up));
                    if up {
                        health.clear("hub")
                    } else {
                        health.set("hub", "hub apiserver unreachable")
                    }
                })
                .await;
        });
    }
    let settings = Settings {
        location: args.location.clone(),
        workers: args.workers,
    };
    let (sync, writers) = CellSync::new(settings, rules, cell, hub, hub_health, metrics.clone(), health.clone());
    sync.set_leader(true);
    tasks.spawn(Arc::clone(&sync).run(writers, cancel.clone()));
    tasks.spawn(sweep::run(
        Arc::clone(&sync),
        metrics,
        sweep::Settings {
            interval: args.sweep_interval,
            max_deletes: args.sweep_max_deletes,
        },
        cancel.clone(),
    ));

    let mut result = Ok(());
    tokio::select! {
        () = cancel.cancelled() => {}
        Some(served) = servers.join_next() => {
            if let Ok(Err(err)) = served {
                result = Err(err.into());
            }
            cancel.cancel();
        }
    }
    while tasks.join_next().await.is_some() {}
    while servers.join_next().await.is_some() {}
    tracing::info!("stopped");
    result
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
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("ten minutes").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(
            parse_duration("99999999999999999h").is_err(),
            "overflow is an error, not a panic"
        );
        assert!(parse_sweep_interval("0").is_err());
        assert!(parse_sweep_interval("500ms").is_err());
        assert_eq!(parse_sweep_interval("2s"), Ok(Duration::from_secs(2)));
    }
}
