//! `karmada-propagation`: how long Karmada takes to carry a hub object to a member.
//!
//! Creates `--objects` ConfigMaps (default 200) in a fresh namespace on the hub, selected by one
//! ClusterPropagationPolicy for every member, and watches the members. For each object and
//! member it records the time from the hub acknowledging the create to the member's watch
//! delivering the copy, then prints p50, p90, p99 and max per member and overall.
//!
//! ```text
//! karmada-propagation [--objects 200] [--rate 10] [--timeout 300]
//! ```
//!
//! `--rate` paces the creates (objects per second; 0 creates them back to back, a burst).
//! The environment is brought up (or reused) as by `replicator-env up`. At the end the
//! ConfigMaps are deleted, the run waits until Karmada has removed the copies, and the policy is
//! deleted; the namespace stays.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use replicator_e2e::propagation::{self, Params, quantile};
use replicator_e2e::{Cluster, Environment};
use tracing_subscriber::EnvFilter;

/// Measure Karmada's hub → member propagation latency on the local environment.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// How many ConfigMaps to create on the hub.
    #[arg(long, default_value_t = 200)]
    objects: usize,
    /// Creates per second (0: all at once).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Give up after this many seconds of waiting for the copies.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if cli.objects == 0 {
        bail!("--objects must be at least 1");
    }
    let env = Environment::ensure_up().await.context("bringing the environment up")?;
    let params = Params {
        objects: cli.objects,
        rate: cli.rate,
        members: Cluster::MEMBERS.to_vec(),
        timeout: Duration::from_secs(cli.timeout),
    };
    let outcome = propagation::measure(&env, &params).await?;
    println!(
        "Karmada propagation, hub -> member: {} ConfigMaps x {} members, created in {:.1}s ({}), all copies in after {:.1}s",
        outcome.objects,
        params.members.len(),
        outcome.created_in.as_secs_f64(),
        if cli.rate > 0.0 {
            format!("{} per second", cli.rate)
        } else {
            "burst".to_owned()
        },
        outcome.all_in.as_secs_f64()
    );
    println!(
        "  {:<8} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "member", "copies", "p50", "p90", "p99", "max"
    );
    for (member, latencies) in &outcome.per_member {
        print_row(member.name(), latencies);
    }
    print_row("all", &outcome.all_sorted());
    match outcome.complete {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(error) => {
            eprintln!("incomplete: {error}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Prints one row of percentiles (nearest rank) of `sorted` latencies.
fn print_row(name: &str, sorted: &[Duration]) {
    let at = |q: f64| quantile(sorted, q).map_or_else(|| "-".to_owned(), |d| format!("{:.3}s", d.as_secs_f64()));
    println!(
        "  {:<8} {:>6} {:>9} {:>9} {:>9} {:>9}",
        name,
        sorted.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        at(1.0)
    );
}
