//! `replicator-bench memory`: where the replicator's resident memory goes, phase by phase
//! (issue #5, "Memory ... where a target is missed, profile").
//!
//! Populates the cells, starts one replicator per cell against an empty hub, and samples each
//! process's `VmRSS` (and CPU time) every 100 ms through four phases: start-up until every copy
//! is present, a quiet pause, churn at one rate, and a restart over the correct copies. Prints, per phase and location, the resident memory
//! at the phase's end and the highest sample in it, so a peak can be told apart from a
//! steady cost (a start-up burst, a backlog under churn, or a per-object cache). Extra
//! environment for the replicators (`--replicator-env MALLOC_ARENA_MAX=2`) lets an allocator
//! setting be compared in the same run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::lag::{self, Recorder};
use super::load::Load;
use super::system;
use crate::{Environment, HUB, ReplicatorProcess, fixtures};

/// What to run.
#[derive(Debug, Clone)]
pub struct Params {
    /// Objects over both cells and both kinds (a multiple of 4).
    pub objects: usize,
    /// Churn rate, writes per second.
    pub rate: f64,
    /// Churn length.
    pub churn: Duration,
    /// The replicator binary.
    pub replicator_bin: std::path::PathBuf,
    /// `--workers` of each replicator.
    pub workers: usize,
    /// Extra environment for the replicators.
    pub env: Vec<(String, String)>,
    /// Deadline of the start-up.
    pub timeout: Duration,
    /// Leave the sources and copies in place at the end (for a profiler run by hand).
    pub keep: bool,
}

/// Resident memory of one phase, per location, bytes.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// The phase's name.
    pub name: String,
    /// How long it lasted.
    pub elapsed: Duration,
    /// `VmRSS` at the phase's end, per location.
    pub end: BTreeMap<String, u64>,
    /// The highest `VmRSS` sampled in the phase, per location.
    pub high: BTreeMap<String, u64>,
    /// CPU time used in the phase (user + system), per location.
    pub cpu: BTreeMap<String, Duration>,
}

/// Samples the processes' `VmRSS` every 100 ms until `stop` fires; the highest per location.
async fn sample(processes: Vec<(String, u32)>, stop: CancellationToken) -> BTreeMap<String, u64> {
    let mut high = BTreeMap::new();
    loop {
        for (location, pid) in &processes {
            let now = system::rss(*pid).map(|r| r.current).unwrap_or_default();
            let entry = high.entry(location.clone()).or_insert(0);
            *entry = (*entry).max(now);
        }
        tokio::select! {
            () = stop.cancelled() => return high,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// (location, pid) of each replicator.
fn processes(replicators: &[ReplicatorProcess]) -> Vec<(String, u32)> {
    replicators.iter().map(|r| (r.location().to_owned(), r.pid())).collect()
}

/// Runs `work` while sampling the replicators' memory; returns its value and the phase.
async fn phase<T>(
    name: &str,
    processes: Vec<(String, u32)>,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Phase)> {
    let stop = CancellationToken::new();
    let sampler = tokio::spawn(sample(processes.clone(), stop.clone()));
    let cpu_before: BTreeMap<String, Duration> = processes
        .iter()
        .map(|(l, pid)| (l.clone(), system::cpu_time(*pid).unwrap_or_default()))
        .collect();
    let start = Instant::now();
    let value = work.await;
    stop.cancel();
    let high = sampler.await.context("the memory sampler panicked")?;
    let end = processes
        .iter()
        .map(|(l, pid)| (l.clone(), system::rss(*pid).map(|r| r.current).unwrap_or_default()))
        .collect();
    let cpu = processes
        .iter()
        .map(|(l, pid)| {
            let used = system::cpu_time(*pid).unwrap_or_default();
            (
                l.clone(),
                used.saturating_sub(cpu_before.get(l).copied().unwrap_or_default()),
            )
        })
        .collect();
    let phase = Phase {
        name: name.to_owned(),
        elapsed: start.elapsed(),
        end,
        high,
        cpu,
    };
    eprintln!("{}", line(&phase));
    Ok((value?, phase))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One printed line: `phase (12.3 s): dfw end 40.1 MiB high 52.0 MiB cpu 1.2 s; sjc ...; total high ...`.
pub fn line(phase: &Phase) -> String {
    let per: Vec<String> = phase
        .end
        .iter()
        .map(|(l, end)| {
            format!(
                "{l} end {} high {} cpu {:.1} s",
                mib(*end),
                mib(phase.high.get(l).copied().unwrap_or_default()),
                phase.cpu.get(l).copied().unwrap_or_default().as_secs_f64()
            )
        })
        .collect();
    format!(
        "[memory] {} ({:.1} s): {}; total high {}",
        phase.name,
        phase.elapsed.as_secs_f64(),
        per.join("; "),
        mib(phase.high.values().sum())
    )
}

/// One replicator per cell (`dfw`, `sjc`) with the profile's binary, workers and environment.
async fn spawn(env: &Environment, params: &Params) -> anyhow::Result<Vec<ReplicatorProcess>> {
    super::spawn_pair(env, &params.replicator_bin, params.workers, &[], &params.env).await
}

/// Prints each process's `VmHWM`, then stops it.
async fn stop(replicators: &mut [ReplicatorProcess], what: &str) -> anyhow::Result<()> {
    for r in replicators.iter() {
        let peak = system::rss(r.pid()).map(|r| r.peak).unwrap_or_default();
        eprintln!("[memory] {what}{} VmHWM {}", r.location(), mib(peak));
    }
    for r in replicators.iter_mut() {
        r.terminate(Duration::from_secs(10)).await?;
    }
    Ok(())
}

/// Runs the profile (see the module documentation) and returns the phases; every replicator's
/// `VmHWM` is printed at the end.
///
/// # Errors
/// A failed population, start-up or churn.
pub async fn run(env: &Environment, params: &Params) -> anyhow::Result<Vec<Phase>> {
    let namespace = fixtures::unique(&format!("memory-{}", params.objects));
    fixtures::routed_namespace(env, &namespace).await?;
    let run_id = fixtures::unique("memory");
    let load = Arc::new(Load::new(env, &namespace, &run_id).await?);
    load.populate(params.objects).await?;
    eprintln!("[memory] populated {} objects in {namespace}", params.objects);
    let hub = env.client(HUB).await?;
    let cancel = CancellationToken::new();
    let recorder = Recorder::start(
        hub.clone(),
        &namespace,
        &lag::churned_kinds()?,
        &format!("{} in (dfw,sjc)", replicator::rules::LOCATION_LABEL),
        params.timeout,
        cancel.child_token(),
    )
    .await?;
    let mut replicators = spawn(env, params).await?;
    let mut phases = Vec::new();
    let ((), p) = phase("start-up to all copies", processes(&replicators), async {
        recorder.wait_present(params.objects, params.timeout).await.map(|_| ())
    })
    .await?;
    phases.push(p);
    let ((), p) = phase("quiet 10 s", processes(&replicators), async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Ok(())
    })
    .await?;
    phases.push(p);
    let ((), p) = phase(&format!("churn at {}/s", params.rate), processes(&replicators), async {
        let stats = load.churn(params.rate, params.churn, &recorder, 0).await?;
        let missing = recorder.settle(0, params.timeout).await;
        eprintln!(
            "[memory] churn: {} writes ({:.0}/s), {missing} missing",
            stats.acked,
            stats.achieved()
        );
        Ok(())
    })
    .await?;
    phases.push(p);
    stop(&mut replicators, "").await?;
    // A restart over correct copies: both caches list full at once and every key is verified.
    let mut replicators = spawn(env, params).await?;
    let ((), p) = phase(
        "restart over correct copies, then 15 s",
        processes(&replicators),
        async {
            for r in &mut replicators {
                r.wait_ready(params.timeout).await?;
            }
            tokio::time::sleep(Duration::from_secs(15)).await;
            Ok(())
        },
    )
    .await?;
    phases.push(p);
    stop(&mut replicators, "restarted ").await?;
    cancel.cancel();
    if params.keep {
        eprintln!("[memory] kept the sources and copies in namespace {namespace}");
    } else {
        super::delete_copies(&hub, &namespace, replicator::rules::LOCATION_LABEL, params.timeout).await?;
        load.delete_all().await?;
    }
    Ok(phases)
}
