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

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use replicator_e2e::fixtures::unique;
use replicator_e2e::karmada::cluster_propagation_policy_resource;
use replicator_e2e::{Cluster, Environment, HUB, wait};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;
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

/// The label selecting the benchmark's ConfigMaps.
const BENCH_LABEL: &str = "replicator-e2e/propagation-bench";

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
    let ns = unique("karmada-bench");
    let deadline = Duration::from_secs(cli.timeout);

    // The namespace first, on every member, so that no copy waits for it.
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.clone()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(env.client(HUB).await?)
        .create(&PostParams::default(), &namespace)
        .await?;
    for member in Cluster::MEMBERS {
        env.wait_on_member::<Namespace>(member, None, &ns, deadline, |_| true)
            .await?;
    }
    let policies = Api::<DynamicObject>::all_with(env.karmada_client().await?, &cluster_propagation_policy_resource());
    let policy = json!({
        "apiVersion": "policy.karmada.io/v1alpha1",
        "kind": "ClusterPropagationPolicy",
        "metadata": { "name": ns },
        "spec": {
            "resourceSelectors": [{
                "apiVersion": "v1", "kind": "ConfigMap", "namespace": ns,
                "labelSelector": { "matchLabels": { BENCH_LABEL: ns } }
            }],
            "placement": {
                "clusterAffinity": { "clusterNames": Cluster::MEMBERS.map(Cluster::name) }
            }
        }
    });
    policies
        .patch(
            &ns,
            &PatchParams::apply("replicator-e2e").force(),
            &Patch::Apply(&policy),
        )
        .await?;

    // Watch every member; each watcher reports (member, name, when first seen).
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<(Cluster, String, Instant)>();
    let mut synced = Vec::new();
    for member in Cluster::MEMBERS {
        let api: Api<ConfigMap> = Api::namespaced(env.client(member).await?, &ns);
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel::<()>();
        synced.push(synced_rx);
        let seen_tx = seen_tx.clone();
        tokio::spawn(async move {
            let mut synced_tx = Some(synced_tx);
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(event) = events.next().await {
                let at = Instant::now();
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => {
                        if let Some(name) = cm.metadata.name {
                            let _ = seen_tx.send((member, name, at));
                        }
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%member, %error, "watch error; retrying"),
                }
            }
        });
    }
    drop(seen_tx);
    for rx in synced {
        rx.await.context("a member watcher ended before its initial list")?;
    }

    // Create the objects, paced, recording when the hub acknowledged each.
    let hub_config_maps: Api<ConfigMap> = Api::namespaced(env.client(HUB).await?, &ns);
    let mut created: BTreeMap<String, Instant> = BTreeMap::new();
    let mut pace = (cli.rate > 0.0).then(|| tokio::time::interval(Duration::from_secs_f64(1.0 / cli.rate)));
    let started = Instant::now();
    for i in 0..cli.objects {
        if let Some(pace) = pace.as_mut() {
            pace.tick().await;
        }
        let name = format!("object-{i:04}");
        let object = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(BENCH_LABEL.to_owned(), ns.clone())])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([("index".to_owned(), i.to_string())])),
            ..ConfigMap::default()
        };
        hub_config_maps.create(&PostParams::default(), &object).await?;
        created.insert(name, Instant::now());
    }
    let created_in = started.elapsed();

    // Collect first sightings until every (object, member) pair is in, or the deadline passes.
    let expected = cli.objects * Cluster::MEMBERS.len();
    let mut first_seen: BTreeMap<(Cluster, String), Instant> = BTreeMap::new();
    let collected = wait::until(deadline, "every copy on every member", || {
        while let Ok((member, name, at)) = seen_rx.try_recv() {
            first_seen.entry((member, name)).or_insert(at);
        }
        let done = first_seen.len() >= expected;
        let count = first_seen.len();
        async move {
            if done {
                Ok(Some(()))
            } else {
                Err(format!("{count} of {expected} copies seen"))
            }
        }
    })
    .await;
    let all_in = started.elapsed();

    let mut per_member: BTreeMap<Cluster, Vec<Duration>> = BTreeMap::new();
    for ((member, name), at) in &first_seen {
        if let Some(created_at) = created.get(name) {
            per_member
                .entry(*member)
                .or_default()
                .push(at.saturating_duration_since(*created_at));
        }
    }
    println!(
        "Karmada propagation, hub -> member: {} ConfigMaps x {} members, created in {:.1}s ({}), all copies in after {:.1}s",
        cli.objects,
        Cluster::MEMBERS.len(),
        created_in.as_secs_f64(),
        if cli.rate > 0.0 {
            format!("{} per second", cli.rate)
        } else {
            "burst".to_owned()
        },
        all_in.as_secs_f64()
    );
    println!(
        "  {:<8} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "member", "copies", "p50", "p90", "p99", "max"
    );
    let mut overall = Vec::new();
    for (member, latencies) in &mut per_member {
        print_row(member.name(), latencies);
        overall.extend(latencies.iter().copied());
    }
    print_row("all", &mut overall);

    // Clean up, and wait until Karmada has removed the copies, so that whatever runs next on
    // the environment does not share it with 600 deletions.
    let selector = ListParams::default().labels(&format!("{BENCH_LABEL}={ns}"));
    hub_config_maps
        .delete_collection(&DeleteParams::default(), &selector)
        .await?;
    for member in Cluster::MEMBERS {
        let api: Api<ConfigMap> = Api::namespaced(env.client(member).await?, &ns);
        let what = format!("the copies to be gone from {member}");
        wait::until(deadline, &what, || async {
            let left = api.list_metadata(&selector).await?.items.len();
            Ok::<_, anyhow::Error>((left == 0).then_some(()))
        })
        .await?;
    }
    policies.delete(&ns, &DeleteParams::default()).await?;
    match collected {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(error) => {
            eprintln!("incomplete: {error}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Prints one row of percentiles (nearest rank) of `latencies`, which it sorts.
fn print_row(name: &str, latencies: &mut [Duration]) {
    latencies.sort();
    let at = |q: f64| -> String {
        if latencies.is_empty() {
            return "-".to_owned();
        }
        let rank = ((q * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len());
        format!("{:.3}s", latencies[rank - 1].as_secs_f64())
    };
    println!(
        "  {:<8} {:>6} {:>9} {:>9} {:>9} {:>9}",
        name,
        latencies.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        at(1.0)
    );
}
