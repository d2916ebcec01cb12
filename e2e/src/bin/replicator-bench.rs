//! `replicator-bench`: the replicator's propagation lag, cost at rest, memory and start-up on the
//! local real control plane, each against a baseline measured in the same run (the minimal relay,
//! watch renewals, a plain LIST) and Karmada's own propagation as the peer (issue #5; see
//! `replicator_e2e::bench`).
//!
//! ```text
//! replicator-bench [--short] [--out target/bench] [--counts 1000,10000] [--rates 50,200,500]
//!                  [--churn-seconds 30] [--idle-seconds 60] ...
//! replicator-bench relay --location dfw-relay --cell-kubeconfig C --hub-kubeconfig H [--workers 8]
//!                        [--source-label KEY=VALUE]
//! ```
//!
//! Writes `<out>/results.md` and `<out>/lag.png` and prints the table. The environment is brought
//! up (or reused) as by `replicator-env up`; the replicator binary is `$REPLICATOR_BIN`, else
//! the one beside this binary. Exits non-zero only when the run fails, not on a missed target.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use replicator_e2e::bench::{self, Options};
use replicator_e2e::{EDGE_1, Environment};
use tracing_subscriber::EnvFilter;

/// Benchmark the replicator against a minimal relay and Karmada on the local control plane.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The CI run: small counts, short windows (about a minute in all).
    #[arg(long)]
    short: bool,
    /// Where results.md and lag.png go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Object counts, comma-separated (default 1000,10000; short: 200).
    #[arg(long, value_delimiter = ',')]
    counts: Option<Vec<usize>>,
    /// Churn rates in writes per second, comma-separated (default 50,200,500; short: 50,200).
    #[arg(long, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// The rate the lag targets are judged at.
    #[arg(long, default_value_t = 200.0)]
    target_rate: f64,
    /// Churn windows per mirror at the target rate, the mirrors taking turns, pooled (default
    /// 3; short: 2).
    #[arg(long)]
    target_windows: Option<usize>,
    /// Seconds of churn per rate (default 30; short: 2).
    #[arg(long)]
    churn_seconds: Option<f64>,
    /// Most seconds to wait after a churn window for its writes to show (default 120; short: 20).
    #[arg(long)]
    settle_seconds: Option<f64>,
    /// Seconds of the idle window (default 60; short: 5).
    #[arg(long)]
    idle_seconds: Option<f64>,
    /// `--sweep-interval` of the restarted replicators, seconds (default 15; short: 2).
    #[arg(long)]
    sweep_seconds: Option<f64>,
    /// The replicator's `--workers`, and the relay's concurrent writers (per process).
    #[arg(long, default_value_t = replicator::cli::DEFAULT_WORKERS)]
    workers: usize,
    /// Karmada's creates per second (default: the target rate).
    #[arg(long)]
    peer_rate: Option<f64>,
    /// Deadline of each start-up and of Karmada's propagation, seconds (default 600; short: 120).
    #[arg(long)]
    timeout: Option<u64>,
    /// An argument added to every replicator started (repeat for several), e.g.
    /// `--replicator-arg=--echo-bookkeeping=false`.
    #[arg(long = "replicator-arg", allow_hyphen_values = true)]
    replicator_args: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The minimal relay (the floor), one cell: watch, server-side apply to the hub, nothing else.
    Relay {
        /// The location the relay publishes under on the hub (the benchmark gives the relay of
        /// cell location `dfw` a location of its own, `dfw-relay`): the copies' location label
        /// and name suffix.
        #[arg(long)]
        location: String,
        /// The cell's kubeconfig.
        #[arg(long)]
        cell_kubeconfig: PathBuf,
        /// The hub's kubeconfig: the identity of `--location` (`replicator-<location>`), which
        /// the hub's admission policies allow to write that location's copies.
        #[arg(long)]
        hub_kubeconfig: PathBuf,
        /// Concurrent hub writers (both kinds together).
        #[arg(long, default_value_t = replicator::cli::DEFAULT_WORKERS)]
        workers: usize,
        /// Watch only sources with this `KEY=VALUE` label (instead of the replicator's loop
        /// guard), so the relay and the replicator can run side by side over disjoint sources.
        #[arg(long, value_parser = key_value)]
        source_label: Option<(String, String)>,
    },
    /// Where the replicator's memory goes: resident memory per phase (start-up, quiet, churn).
    Memory {
        /// Objects over both cells and both kinds (a multiple of 4).
        #[arg(long, default_value_t = 10_000)]
        objects: usize,
        /// Churn rate, writes per second.
        #[arg(long, default_value_t = 200.0)]
        rate: f64,
        /// Seconds of churn.
        #[arg(long, default_value_t = 20.0)]
        churn_seconds: f64,
        /// Extra environment of the replicators, `KEY=VALUE` (repeat).
        #[arg(long = "replicator-env", value_parser = key_value)]
        replicator_env: Vec<(String, String)>,
        /// Leave the sources and copies in place at the end (to run a profiler by hand).
        #[arg(long)]
        keep: bool,
    },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

fn secs(value: Option<f64>, full: f64, short: f64, is_short: bool) -> Duration {
    Duration::from_secs_f64(value.unwrap_or(if is_short { short } else { full }))
}

/// The replicator beside this binary (same profile), else the harness default.
fn replicator_binary() -> PathBuf {
    if std::env::var_os("REPLICATOR_BIN").is_none_or(|v| v.is_empty())
        && let Some(beside) = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("replicator")))
            .filter(|p| p.is_file())
    {
        return beside;
    }
    replicator_e2e::ReplicatorProcess::binary_path()
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(Command::Relay {
        location,
        cell_kubeconfig,
        hub_kubeconfig,
        workers,
        source_label,
    }) = cli.command
    {
        let cell = replicator_e2e::kubeconfig::client(&cell_kubeconfig).await?;
        let hub = replicator_e2e::kubeconfig::client(&hub_kubeconfig).await?;
        bench::relay::run(cell, hub, location, workers, source_label).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(Command::Memory {
        objects,
        rate,
        churn_seconds,
        replicator_env,
        keep,
    }) = cli.command
    {
        anyhow::ensure!(
            objects >= 4 && objects.is_multiple_of(4),
            "--objects must be a multiple of 4"
        );
        let env = Environment::ensure_up().await.context("bringing the environment up")?;
        let params = bench::memory::Params {
            objects,
            rate,
            churn: Duration::from_secs_f64(churn_seconds),
            replicator_bin: replicator_binary(),
            workers: cli.workers,
            env: replicator_env,
            timeout: Duration::from_secs(cli.timeout.unwrap_or(600)),
            keep,
        };
        for phase in bench::memory::run(&env, &params).await? {
            println!("{}", bench::memory::line(&phase));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let short = cli.short;
    let options = Options {
        counts: cli
            .counts
            .unwrap_or_else(|| if short { vec![200] } else { vec![1_000, 10_000] }),
        rates: cli.rates.unwrap_or_else(|| {
            if short {
                vec![50.0, 200.0]
            } else {
                vec![50.0, 200.0, 500.0]
            }
        }),
        target_rate: cli.target_rate,
        target_windows: cli.target_windows.unwrap_or(if short { 2 } else { 3 }),
        churn: secs(cli.churn_seconds, 30.0, 2.0, short),
        settle: secs(cli.settle_seconds, 120.0, 20.0, short),
        workers: cli.workers,
        sweep_interval: secs(cli.sweep_seconds, 15.0, 2.0, short),
        idle: secs(cli.idle_seconds, 60.0, 5.0, short),
        peer_rate: cli.peer_rate.unwrap_or(cli.target_rate),
        peer_member: EDGE_1,
        timeout: Duration::from_secs(cli.timeout.unwrap_or(if short { 120 } else { 600 })),
        replicator_bin: replicator_binary(),
        replicator_args: cli.replicator_args,
        relay_bin: std::env::current_exe().context("locating this binary (the relay)")?,
        mode: if short { "short" } else { "full" }.to_owned(),
    };
    anyhow::ensure!(
        !options.counts.is_empty() && !options.rates.is_empty(),
        "--counts and --rates need at least one value"
    );
    anyhow::ensure!(
        options.counts.iter().all(|c| *c >= 4 && c.is_multiple_of(4)),
        "--counts must be multiples of 4 (two cells × two kinds)"
    );
    let env = Environment::ensure_up().await.context("bringing the environment up")?;
    let results = bench::run(&env, options).await?;
    let out = std::path::absolute(&cli.out)?;
    let markdown = bench::write_outputs(&results, &out)?;
    println!("{markdown}");
    eprintln!(
        "[bench] wrote {} and {}",
        out.join("results.md").display(),
        out.join("lag.png").display()
    );
    Ok(ExitCode::SUCCESS)
}
