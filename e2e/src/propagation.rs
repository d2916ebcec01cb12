//! Karmada's own propagation: how long Karmada takes to carry a hub object to a member.
//!
//! [`measure`] creates ConfigMaps in a fresh namespace on the hub, selected by one
//! ClusterPropagationPolicy for the chosen members, and watches the members. For each object and
//! member it records the time from the hub acknowledging the create to the member's watch
//! delivering the copy. At the end the ConfigMaps are deleted, it waits until Karmada has removed
//! the copies, and deletes the policy; the namespace stays. `karmada-propagation` prints the
//! result; `replicator-bench` compares the replicator with it (the peer figure).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::time::Instant;

use crate::fixtures::unique;
use crate::karmada::cluster_propagation_policy_resource;
use crate::{Cluster, Environment, HUB, wait};

/// The label selecting the benchmark's ConfigMaps (its value is the namespace).
pub const BENCH_LABEL: &str = "replicator-e2e/propagation-bench";
/// Most creates in flight at once (pacing permitting).
const MAX_IN_FLIGHT: usize = 32;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Params {
    /// How many ConfigMaps to create on the hub (at least 1).
    pub objects: usize,
    /// Creates per second; 0 creates them as fast as [`MAX_IN_FLIGHT`] concurrent creates go.
    pub rate: f64,
    /// The members the policy places the ConfigMaps on.
    pub members: Vec<Cluster>,
    /// How long to wait for every copy (and, separately, for the clean-up).
    pub timeout: Duration,
}

/// What was measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// ConfigMaps created.
    pub objects: usize,
    /// Time from the first create to the last acknowledged create.
    pub created_in: Duration,
    /// Time from the first create to the last copy seen (or to the deadline).
    pub all_in: Duration,
    /// Per member, the lag of every copy seen: hub create acknowledged → member watch event.
    pub per_member: BTreeMap<Cluster, Vec<Duration>>,
    /// `Err` with what was missing when some copies never arrived before the deadline.
    pub complete: Result<(), String>,
}

impl Outcome {
    /// Every lag, of every member, sorted.
    pub fn all_sorted(&self) -> Vec<Duration> {
        let mut all: Vec<Duration> = self.per_member.values().flatten().copied().collect();
        all.sort();
        all
    }
}

/// The `q` quantile (0..=1, nearest rank) of `sorted`; `None` when it is empty.
pub fn quantile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Creates `object`, retrying a few times (100 ms, doubling) when the connection fails, as it
/// may on a loaded machine; an API error or a fifth failure is returned. A retried create may
/// find the object already created (409): that counts as created.
async fn create_retrying(api: &Api<ConfigMap>, object: &ConfigMap) -> Result<(), kube::Error> {
    let params = PostParams::default();
    match crate::wait::retrying(|| api.create(&params, object)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error),
    }
}

/// Runs one measurement on `env` (see the module documentation).
///
/// # Errors
/// API errors creating the namespace, policy or ConfigMaps, a member that never receives the
/// namespace, or copies that are not removed within the timeout at the end. Copies that never
/// arrive are not an error: [`Outcome::complete`] says so.
pub async fn measure(env: &Environment, params: &Params) -> anyhow::Result<Outcome> {
    if params.objects == 0 {
        bail!("at least one object is needed");
    }
    if params.members.is_empty() {
        bail!("at least one member is needed");
    }
    let ns = unique("karmada-bench");
    let deadline = params.timeout;

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
    for member in &params.members {
        env.wait_on_member::<Namespace>(*member, None, &ns, deadline, |_| true)
            .await?;
    }
    let policies = Api::<DynamicObject>::all_with(env.karmada_client().await?, &cluster_propagation_policy_resource());
    let member_names: Vec<&str> = params.members.iter().map(|m| m.name()).collect();
    let policy = json!({
        "apiVersion": "policy.karmada.io/v1alpha1",
        "kind": "ClusterPropagationPolicy",
        "metadata": { "name": ns },
        "spec": {
            "resourceSelectors": [{
                "apiVersion": "v1", "kind": "ConfigMap", "namespace": ns,
                "labelSelector": { "matchLabels": { BENCH_LABEL: ns } }
            }],
            "placement": { "clusterAffinity": { "clusterNames": member_names } }
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
    let mut watchers = Vec::new();
    for member in params.members.iter().copied() {
        let api: Api<ConfigMap> = Api::namespaced(env.client(member).await?, &ns);
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel::<()>();
        synced.push(synced_rx);
        let seen_tx = seen_tx.clone();
        watchers.push(tokio::spawn(async move {
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
        }));
    }
    drop(seen_tx);
    for rx in synced {
        rx.await.context("a member watcher ended before its initial list")?;
    }

    // Create the objects, paced, recording when the hub acknowledged each.
    let hub_config_maps: Api<ConfigMap> = Api::namespaced(env.client(HUB).await?, &ns);
    let created: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
    let mut pace = (params.rate > 0.0).then(|| tokio::time::interval(Duration::from_secs_f64(1.0 / params.rate)));
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut creates = tokio::task::JoinSet::new();
    let started = Instant::now();
    for i in 0..params.objects {
        if let Some(pace) = pace.as_mut() {
            pace.tick().await;
        }
        let permit = Arc::clone(&in_flight).acquire_owned().await?;
        let name = format!("object-{i:05}");
        let object = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(BENCH_LABEL.to_owned(), ns.clone())])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([("index".to_owned(), i.to_string())])),
            ..ConfigMap::default()
        };
        let (api, created) = (hub_config_maps.clone(), Arc::clone(&created));
        creates.spawn(async move {
            let result = create_retrying(&api, &object).await;
            let at = Instant::now();
            drop(permit);
            result?;
            created.lock().await.insert(name, at);
            Ok::<_, kube::Error>(())
        });
    }
    while let Some(done) = creates.join_next().await {
        done??;
    }
    let created_in = started.elapsed();

    // Collect first sightings until every (object, member) pair is in, or the deadline passes.
    let expected = params.objects * params.members.len();
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
    for watcher in watchers {
        watcher.abort();
    }

    let created = created.lock().await;
    let mut per_member: BTreeMap<Cluster, Vec<Duration>> = BTreeMap::new();
    for ((member, name), at) in &first_seen {
        if let Some(created_at) = created.get(name) {
            per_member
                .entry(*member)
                .or_default()
                .push(at.saturating_duration_since(*created_at));
        }
    }
    for latencies in per_member.values_mut() {
        latencies.sort();
    }

    // Clean up, and wait until Karmada has removed the copies, so that whatever runs next on
    // the environment does not share it with the deletions. The measurement is done: a slow
    // clean-up (Karmada removes 10,000 copies at some 15 per second here, and a collection
    // delete that large outlives the apiserver's 60 s request timeout while it goes on) is
    // reported, not fatal.
    let selector = ListParams::default().labels(&format!("{BENCH_LABEL}={ns}"));
    let delete_params = DeleteParams::default();
    if let Err(error) = crate::wait::retrying(|| hub_config_maps.delete_collection(&delete_params, &selector)).await {
        tracing::warn!(%error, "deleting the ConfigMaps did not finish in one request; waiting for them to go");
    }
    let cleanup = deadline.max(Duration::from_secs(params.objects as u64 / 5));
    for member in &params.members {
        let api: Api<ConfigMap> = Api::namespaced(env.client(*member).await?, &ns);
        let what = format!("the copies to be gone from {member}");
        let gone = wait::until(cleanup, &what, || async {
            let left = api.list_metadata(&selector).await?.items.len();
            Ok::<_, anyhow::Error>((left == 0).then_some(()))
        })
        .await;
        if let Err(error) = gone {
            eprintln!("warning: Karmada's clean-up is not finished: {error}");
        }
    }
    let delete_params = DeleteParams::default();
    crate::wait::retrying(|| policies.delete(&ns, &delete_params)).await?;
    Ok(Outcome {
        objects: params.objects,
        created_in,
        all_in,
        per_member,
        complete: collected.map_err(|e| e.to_string()),
    })
}
