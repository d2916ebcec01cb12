//! `replicator-bench memory`: where the replicator's resident memory goes, phase by phase
//! (issue #5, "Memory ... where a target is missed, profile").
//!
//! Populates the cells, starts one replicator per cell against an empty hub, and samples each
//! process's `VmRSS` every 100 ms through three phases: start-up until every copy is present,
//! a quiet pause, and churn at one rate. Prints, per phase and location, the resident memory
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
use crate::{CELL_A, CELL_B, Environment, HUB, ReplicatorProcess, ReplicatorSpec, fixtures};

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

/// Runs `work` while sampling the replicators' memory; returns its value and the phase.
async fn phase<T>(
    name: &str,
    replicators: &[ReplicatorProcess],
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Phase)> {
    let processes: Vec<(String, u32)> = replicators.iter().map(|r| (r.location().to_owned(), r.pid())).collect();
    let stop = CancellationToken::new();
    let sampler = tokio::spawn(sample(processes.clone(), stop.clone()));
    let start = Instant::now();
    let value = work.await;
    stop.cancel();
    let high = sampler.await.context("the memory sampler panicked")?;
    let end = processes
        .iter()
        .map(|(l, pid)| (l.clone(), system::rss(*pid).map(|r| r.current).unwrap_or_default()))
        .collect();
    let phase = Phase {
        name: name.to_owned(),
        elapsed: start.elapsed(),
        end,
        high,
    };
    eprintln!("{}", line(&phase));
    Ok((value?, phase))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One printed line: `phase (12.3 s): dfw end 40.1 MiB high 52.0 MiB; sjc ...; total high ...`.
pub fn line(phase: &Phase) -> String {
    let per: Vec<String> = phase
        .end
        .iter()
        .map(|(l, end)| {
            format!(
                "{l} end {} high {}",
                mib(*end),
                mib(phase.high.get(l).copied().unwrap_or_default())
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
    let mut replicators = Vec::new();
    for cell in [CELL_A, CELL_B] {
        let location = cell.location().context("a cell without a location")?;
        let mut spec = ReplicatorSpec::new(cell)
            .location(location)
            .binary(&params.replicator_bin)
            .args(["--workers".to_owned(), params.workers.to_string()]);
        for (k, v) in &params.env {
            spec = spec.env(k, v);
        }
        replicators.push(ReplicatorProcess::spawn(env, spec).await?);
    }
    let mut phases = Vec::new();
    let ((), p) = phase("start-up to all copies", &replicators, async {
        recorder.wait_present(params.objects, params.timeout).await.map(|_| ())
    })
    .await?;
    phases.push(p);
    let ((), p) = phase("quiet 10 s", &replicators, async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        Ok(())
    })
    .await?;
    phases.push(p);
    let ((), p) = phase(&format!("churn at {}/s", params.rate), &replicators, async {
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
    for r in &replicators {
        let peak = system::rss(r.pid()).map(|r| r.peak).unwrap_or_default();
        eprintln!("[memory] {} VmHWM {}", r.location(), mib(peak));
    }
    for r in &mut replicators {
        r.terminate(Duration::from_secs(10)).await?;
    }
    cancel.cancel();
    super::delete_copies(&hub, &namespace, replicator::rules::LOCATION_LABEL, params.timeout).await?;
    load.delete_all().await?;
    Ok(phases)
}
