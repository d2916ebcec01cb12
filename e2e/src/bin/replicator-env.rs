//! `replicator-env`: brings the local real control plane up or down, and reports on it.
//!
//! ```text
//! replicator-env up                  start (or reuse) etcd, the hub/cell-a/cell-b/edge-1 apiservers,
//!                                    Karmada on the hub, members registered, and each cell as a
//!                                    one-node cluster (containerd, kubelet, scheduler,
//!                                    controller-manager) with the product image imported
//! replicator-env status              per component: url, health, pid; per Karmada member: Ready
//! replicator-env kubeconfig cell-a   print the path of a cluster's kubeconfig
//! replicator-env down                stop everything started from the state directory
//! replicator-env leftovers           after down: list what is left on the host; exit 1 if any
//! replicator-env audit               the hub audit log: writes per replicator identity, and those
//!                                    to objects not its own (issue #18); exit 1 if any, or none
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use replicator_e2e::{Cluster, Environment, controlplane, paths};
use tracing_subscriber::EnvFilter;

/// Manage the local e2e control plane (one etcd; kube-apiservers hub, cell-a, cell-b and edge-1;
/// Karmada on the hub with the other three as members).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// State directory of the environment [default: <workspace>/target/replicator-env].
    #[arg(long, env = paths::ENV_DIR_VAR, global = true)]
    dir: Option<PathBuf>,

    #[command(subcommand)]
    command: Commands,
}

#[derive(Debug, Subcommand)]
enum Commands {
    /// Start the environment, or reuse it if it is already up and healthy.
    Up,
    /// Stop every process of the environment.
    Down,
    /// Show each component's URL, readiness and pid, and each Karmada member's readiness; exits 1
    /// unless all are healthy.
    Status,
    /// List what a stopped environment left on the host (processes, mounts, cgroups, network
    /// interfaces, iptables rules and chains); exits 1 if anything is left.
    Leftovers,
    /// Read the hub's audit log: count the successful writes of each replicator identity
    /// (`replicator-<location>`, `replicator-membership`) and list those made to objects that are
    /// not its own (another location's copy, a hand-made object, another Lease); exits 1 if any,
    /// or if the log holds no replicator write at all (an unaudited hub proves nothing).
    Audit,
    /// Print the path of a cluster's admin kubeconfig (hub, cell-a, cell-b or edge-1).
    Kubeconfig {
        /// The cluster.
        cluster: Cluster,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let dir = cli
        .dir
        .map(|dir| std::path::absolute(&dir).unwrap_or(dir))
        .unwrap_or_else(paths::state_dir);
    match cli.command {
        Commands::Up => up(&dir).await,
        Commands::Down => {
            controlplane::teardown(&dir)
                .await
                .with_context(|| format!("stopping the environment at {}", dir.display()))?;
            println!("environment at {} is down", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Commands::Status => status(&dir).await,
        Commands::Leftovers => {
            let found = controlplane::leftovers(&dir)
                .await
                .with_context(|| format!("looking for leftovers of {}", dir.display()))?;
            if found.is_empty() {
                println!("nothing of the environment at {} is left on the host", dir.display());
                return Ok(ExitCode::SUCCESS);
            }
            println!("left on the host by the environment at {}:", dir.display());
            for line in &found {
                println!("  {line}");
            }
            Ok(ExitCode::FAILURE)
        }
        Commands::Audit => audit(&dir),
        Commands::Kubeconfig { cluster } => {
            let path = controlplane::kubeconfig_path(&dir, cluster);
            anyhow::ensure!(
                path.is_file(),
                "{} does not exist; run `replicator-env up` first",
                path.display()
            );
            println!("{}", path.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn up(dir: &Path) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let env = Environment::ensure_up_at(dir)
        .await
        .with_context(|| format!("bringing the environment at {} up", dir.display()))?;
    if env.reused() {
        println!("environment already up at {}; reusing it", env.dir().display());
    } else {
        println!(
            "environment up at {} (started in {:.1}s)",
            env.dir().display(),
            started.elapsed().as_secs_f64()
        );
    }
    for cluster in Cluster::ALL {
        println!(
            "  {:<7} {}  {}",
            cluster.name(),
            env.server_url(cluster),
            env.kubeconfig_path(cluster).display()
        );
    }
    println!("  {:<7} {}", "etcd", env.etcd_url());
    for cell in Cluster::CELLS {
        let node = env.node(cell);
        println!(
            "  node {} (cell {cell}): Ready; pods {} on bridge {}, containerd {}",
            node.node_name(),
            node.pod_cidr(),
            node.bridge(),
            node.containerd_socket().display()
        );
    }
    for member in Cluster::MEMBERS {
        let location = member
            .location()
            .map_or_else(String::new, |location| format!(", location {location}"));
        println!("  Karmada member {member} (push mode{location}): Ready");
    }
    println!();
    println!("export {}={}", paths::ENV_DIR_VAR, env.dir().display());
    for cluster in Cluster::ALL {
        let var = format!("KUBECONFIG_{}", cluster.name().replace('-', "_").to_uppercase());
        println!("export {var}={}", env.kubeconfig_path(cluster).display());
    }
    let merged: Vec<String> = Cluster::ALL
        .into_iter()
        .map(|cluster| env.kubeconfig_path(cluster).display().to_string())
        .collect();
    println!(
        "export KUBECONFIG={}  # contexts: {}",
        merged.join(":"),
        Cluster::ALL.map(Cluster::name).join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

async fn status(dir: &Path) -> anyhow::Result<ExitCode> {
    let status = match controlplane::status(dir).await {
        Ok(status) => status,
        Err(replicator_e2e::Error::NotUp(dir)) => {
            println!("no environment at {}", dir.display());
            return Ok(ExitCode::FAILURE);
        }
        Err(error) => return Err(error).context("reading the environment's status"),
    };
    println!("environment at {}", status.dir.display());
    println!(
        "  {:<30} {:<34} {:<8} {:<8} ready",
        "component", "url", "pid", "running"
    );
    for component in &status.components {
        let pid = component.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string());
        let ready = match &component.ready {
            Ok(()) => "ok".to_owned(),
            Err(problem) => format!("failed: {problem}"),
        };
        println!(
            "  {:<30} {:<34} {:<8} {:<8} {ready}",
            component.name,
            component.url,
            pid,
            if component.running { "yes" } else { "no" },
        );
    }
    for member in &status.members {
        let ready = match &member.ready {
            Ok(()) => "ok".to_owned(),
            Err(problem) => format!("failed: {problem}"),
        };
        println!("  {:<30} {ready}", format!("Karmada Cluster {}", member.cluster));
    }
    for node in &status.nodes {
        let ready = match &node.ready {
            Ok(()) => "Ready".to_owned(),
            Err(problem) => format!("not Ready: {problem}"),
        };
        println!("  {:<30} {ready}", format!("Node {} ({})", node.name, node.cell));
    }
    Ok(if status.healthy() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn audit(dir: &Path) -> anyhow::Result<ExitCode> {
    let path = controlplane::audit_log_path(dir);
    let log = replicator_e2e::audit::read(&path)?;
    replicator_e2e::audit::require_entries(&log, &path)?;
    let verdict = replicator_e2e::audit::foreign_writes(&log);
    println!(
        "hub audit log {}: {} entries ({} unreadable lines)",
        path.display(),
        log.entries.len(),
        log.unreadable
    );
    for (account, writes) in &verdict.writes {
        let foreign = verdict.foreign.iter().filter(|f| &f.account == account).count();
        println!("  {account}: {writes} writes, {foreign} to objects not its own");
    }
    let total: usize = verdict.writes.values().sum();
    println!(
        "replicator identities: {} accounts, {total} writes, {} to objects not their own",
        verdict.writes.len(),
        verdict.foreign.len()
    );
    if total == 0 {
        println!("no replicator identity wrote anything: the check proves nothing");
        return Ok(ExitCode::FAILURE);
    }
    if verdict.foreign.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    for f in verdict.foreign.iter().take(50) {
        println!("  {} {} {}: {}", f.account, f.verb, f.object, f.why);
    }
    Ok(ExitCode::FAILURE)
}
