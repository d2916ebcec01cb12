//! The product deployed for real: the Deployments of `config/` run by the cells' own kubelets
//! (real pods from the image the repository's Dockerfile builds), the hub reached through a
//! Secret holding a service-account token, as the README's "Deploying" section says.
//!
//! - `pods_wait_for_the_secret_then_lead`: applied before its Secret exists, a deployment waits
//!   (ContainerCreating, no restart); once the Secret is there both pods become Ready, one leads,
//!   and sources reach the hub. Prints `timeline: ...`.
//! - `leader_pod_deleted_under_churn`, `rollout_restart_under_churn`: the standby takes over
//!   within the Lease duration (at once, for a rollout: the old leader releases), with nothing
//!   lost and no copy wrongly deleted while the cell keeps changing.
//! - `readme_deploy_both_cells_and_membership`: the README's steps against cell-a (dfw), cell-b
//!   (sjc) and the hub, `replicator membership` on cell-b as the hub's host; the demo's sample
//!   input reaches the hub and a NetworkService follows a member's `HolderAvailable`.
//! - `bad_hub_secret_keeps_pods_unready_until_fixed`: a hub kubeconfig naming a closed port, or
//!   a rejected token, keeps the pods unready with a log line and an error metric, writes and
//!   withdraws nothing; fixing the Secret recovers without a manual step.
//!
//! A cell has one `replicator-system`: the scenarios take [`deploy::exclusive`] and leave
//! nothing behind (see [`Teardown`]), pass or fail. Each uses a location and Lease of its own,
//! except the README one, which uses dfw and sjc as the README does.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, anyhow, ensure};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DynamicObject, ListParams};
use kube::discovery::ApiResource;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use replicator::api::NetworkService;
use replicator::copy::copy_name;
use replicator::rules::{LOCATION_LABEL, Rule};
use replicator_e2e::deploy::{
    self, Base, CELL_SELECTOR, HUB_SECRET, Holder, MEMBERSHIP_SECRET, MEMBERSHIP_SELECTOR, SYSTEM_NAMESPACE, Teardown,
};
use replicator_e2e::images::Images;
use replicator_e2e::wait::{self, Check};
use replicator_e2e::{CELL_A, CELL_B, Cluster, Environment, HUB, convergence, fixtures, fixtures::unique, metrics};
use serde_json::{Value, json};

type TestResult = anyhow::Result<()>;

/// How long the kubelet may take to report that a pod's Secret volume cannot be mounted.
const FAILED_MOUNT: Duration = Duration::from_secs(60);
/// How long pods are watched still waiting for their Secret once the kubelet reported it.
const WAITING_OBSERVED: Duration = Duration::from_secs(5);
/// How long pods may take to be Ready once their Secret exists (the kubelet retries a failed
/// mount with a backoff that has grown while the pods waited), or after a pod or rollout change.
const PODS_READY: Duration = Duration::from_secs(120);
/// How long a source may take to reach the hub from a running leader ("within seconds").
const COPIES: Duration = Duration::from_secs(15);
/// The Lease duration the Deployment runs with (`--lease-duration`, default 15 s): a standby
/// takes over within it even when the leader never releases.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How soon after the old leader pod's deletion was requested the new holder must have
/// acquired the Lease during a rollout: the terminating leader releases it, so the hand-over
/// does not wait for expiry.
const RELEASE_HANDOVER: Duration = Duration::from_secs(3);
/// How long a rollout restart of two replicas may take (surge one, wait Ready, retire one, twice).
const ROLLOUT: Duration = Duration::from_secs(240);
/// How long deleted pods may take to be gone (30 s grace; the replicator exits at once).
const PODS_GONE: Duration = Duration::from_secs(60);
/// How long the hub may take to match the cell after a fault under churn.
const AFTER_FAULT: Duration = Duration::from_secs(90);
/// The churn: a pace, a size, a bound on its length, and how much of it runs around the fault.
const CHURN_TICK: Duration = Duration::from_millis(250);
const CHURN_OPS_PER_TICK: usize = 4;
const CHURN_POOL: usize = 40;
const CHURN_SEED: usize = 15;
const CHURN_MAX_TICKS: usize = 1200;
const CHURN_TICKS_BEFORE: usize = 8;
const CHURN_TICKS_AFTER: usize = 8;
/// How long the watches recording hand-overs and deletions may take to list.
const WATCH_SYNCED: Duration = Duration::from_secs(30);
/// How long pods with a broken hub kubeconfig may take to run and to report the failure.
const HUB_FAILURE_REPORTED: Duration = Duration::from_secs(90);
/// How long pods with a broken hub kubeconfig are watched staying unready and writing nothing.
const BROKEN_OBSERVED: Duration = Duration::from_secs(10);
/// How long a fixed Secret may take to reach the pods and make them Ready: the kubelet refreshes
/// a Secret volume on its periodic pod sync (up to a minute, plus jitter), then the process
/// restarts on the changed file and lists.
const SECRET_FIXED: Duration = Duration::from_secs(180);
/// How long the hub's NetworkService status and slices may take to follow a member.
const MEMBERSHIP: Duration = Duration::from_secs(30);

fn image() -> anyhow::Result<String> {
    Ok(Images::read(&Images::dir())?.replicator)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn names(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().map(ResourceExt::name_any).collect()
}

/// A location deployed from `config/cell` with its Secret, Ready, with a leader.
struct Deployed {
    location: String,
    overlay: PathBuf,
    kubeconfig: PathBuf,
    pods: Vec<Pod>,
    leader: Holder,
}

/// Deploys a new location in `cell` as a user adds one (overlay of `config/cell`, the location,
/// the local image), with a hub token Secret; waits until both pods are Ready and one leads.
async fn deploy_location(
    env: &Environment,
    cell: Cluster,
    location: &str,
    teardown: &mut Teardown,
) -> anyhow::Result<Deployed> {
    let overlay = deploy::write_overlay(location, Base::NewLocation(location), &image()?)?;
    teardown.path(&overlay);
    teardown.applied(cell, &overlay);
    deploy::apply_hub_rbac_for(env, teardown, &[location]).await?;
    deploy::apply(env, cell, &overlay).await?;
    let kubeconfig = overlay.join("hub.kubeconfig");
    deploy::write_hub_kubeconfig(env, &deploy::run_service_account(location), &kubeconfig).await?;
    deploy::create_secret(env, cell, HUB_SECRET, &kubeconfig).await?;
    let client = env.client(cell).await?;
    let pods = deploy::wait_pods_ready(&client, CELL_SELECTOR, 2, PODS_READY).await?;
    let leader = wait_leader(&env.client(HUB).await?, location, &names(&pods), LEASE_DURATION).await?;
    Ok(Deployed {
        location: location.to_owned(),
        overlay,
        kubeconfig,
        pods,
        leader,
    })
}

/// Waits until the Lease of `location` is held by one of `pods`.
async fn wait_leader(
    hub: &Client,
    location: &str,
    pods: &BTreeSet<String>,
    deadline: Duration,
) -> anyhow::Result<Holder> {
    let what = format!("one of {pods:?} to hold Lease {}", deploy::lease_name(location));
    Ok(wait::until_observed(deadline, &what, || async {
        Ok::<_, replicator_e2e::Error>(match deploy::lease_holder(hub, location).await? {
            Some(h) if pods.contains(h.pod()) => Check::Ready(h),
            other => Check::NotYet(format!("holder {other:?}")),
        })
    })
    .await?)
}

/// The pod the holder identity names (a replica's identity is its pod name): exactly one of
/// `pods`.
fn holding_pod<'a>(holder: &Holder, pods: &'a [Pod]) -> anyhow::Result<&'a Pod> {
    let holding: Vec<&Pod> = pods.iter().filter(|p| holder.identity == p.name_any()).collect();
    match holding.as_slice() {
        [pod] => Ok(pod),
        _ => Err(anyhow!(
            "holder {} names {} of the pods {:?}",
            holder.identity,
            holding.len(),
            names(pods)
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The pods wait for their Secret, then lead and mirror.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn pods_wait_for_the_secret_then_lead() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let cell = CELL_A;
    let (location, ns) = (unique("wait"), unique("waitsrc"));
    deploy::require_free(&env, cell).await?;
    let mut teardown = Teardown::new(&env, &[&location]).await?;
    teardown.cell(cell);
    let (client, hub) = (env.client(cell).await?, env.client(HUB).await?);

    // The overlay a user writes for a new location, applied before any Secret exists.
    let overlay = deploy::write_overlay(&location, Base::NewLocation(&location), &image()?)?;
    teardown.path(&overlay);
    teardown.applied(cell, &overlay);
    deploy::apply_hub_rbac_for(&env, &mut teardown, &[&location]).await?;
    deploy::apply(&env, cell, &overlay).await?;
    let applied = Instant::now();

    let waiting = wait::until_observed(
        FAILED_MOUNT,
        "both pods to have FailedMount events for the hub kubeconfig Secret",
        || async {
            let pods = deploy::pods(&client, CELL_SELECTOR).await?;
            if pods.len() != 2 {
                return Ok::<_, replicator_e2e::Error>(Check::NotYet(deploy::describe_pods(&pods)));
            }
            for pod in &pods {
                let events = deploy::pod_events(&client, &pod.name_any(), "FailedMount").await?;
                if !events.iter().any(|m| m.contains(HUB_SECRET)) {
                    return Ok(Check::NotYet(format!("{}: FailedMount {events:?}", pod.name_any())));
                }
            }
            Ok(Check::Ready(pods))
        },
    )
    .await?;
    let waited = names(&waiting);
    deploy::stays(
        WAITING_OBSERVED,
        "both pods in ContainerCreating, never restarted, no Lease",
        || async {
            let pods = deploy::pods(&client, CELL_SELECTOR).await?;
            let lease = deploy::lease_holder(&hub, &location).await?;
            let still = names(&pods) == waited
                && pods.iter().all(|p| {
                    deploy::waiting_reason(p) == Some("ContainerCreating")
                        && deploy::restart_count(p) == 0
                        && !deploy::is_ready(p)
                });
            Ok::<_, replicator_e2e::Error>(if still && lease.is_none() {
                Check::Ready(())
            } else {
                Check::NotYet(format!("{}; Lease holder {lease:?}", deploy::describe_pods(&pods)))
            })
        },
    )
    .await?;
    eprintln!(
        "both pods waited in ContainerCreating for {:.1}s",
        secs(applied.elapsed())
    );

    // The Secret, as the README makes it: a token of the location's hub service account,
    // replicator-<location>.
    let kubeconfig = overlay.join("hub.kubeconfig");
    deploy::write_hub_kubeconfig(&env, &deploy::run_service_account(&location), &kubeconfig).await?;
    deploy::create_secret(&env, cell, HUB_SECRET, &kubeconfig).await?;
    let secret_at = applied.elapsed();
    let pods = deploy::wait_pods_ready(&client, CELL_SELECTOR, 2, PODS_READY).await?;
    let ready_at = applied.elapsed();
    assert_eq!(names(&pods), waited, "the pods that waited are the ones that started");
    for pod in &pods {
        assert_eq!(deploy::restart_count(pod), 0, "{} never restarted", pod.name_any());
    }
    let holder = wait_leader(&hub, &location, &waited, LEASE_DURATION).await?;
    let leader = holding_pod(&holder, &pods)?;
    eprintln!("Lease {} held by {}", deploy::lease_name(&location), holder.identity);

    // The cell through the in-cluster service account, the hub through the Secret's token.
    for pod in &pods {
        let spec = pod.spec.as_ref().context("pod without spec")?;
        assert_eq!(spec.service_account_name.as_deref(), Some("replicator"));
        let args = spec.containers[0].args.clone().unwrap_or_default();
        assert!(
            !args.iter().any(|a| a.starts_with("--cell-kubeconfig")),
            "no --cell-kubeconfig: {args:?}"
        );
        assert!(
            args.contains(&"--hub-kubeconfig=/etc/karmada-hub/kubeconfig".to_owned()),
            "{args:?}"
        );
        let volumes = spec.volumes.clone().unwrap_or_default();
        assert!(
            volumes
                .iter()
                .any(|v| v.name.starts_with("kube-api-access-") && v.projected.is_some()),
            "the projected service-account token volume: {:?}",
            volumes.iter().map(|v| &v.name).collect::<Vec<_>>()
        );
        assert!(
            volumes
                .iter()
                .any(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(HUB_SECRET)),
            "the Secret volume"
        );
    }
    let whoami = env
        .kubectl_ok(
            HUB,
            [
                "--kubeconfig",
                &kubeconfig.display().to_string(),
                "auth",
                "whoami",
                "-o",
                "jsonpath={.status.userInfo.username}",
            ],
        )
        .await?;
    assert_eq!(
        whoami,
        format!("system:serviceaccount:replicator-system:replicator-{location}")
    );

    // Sources in the cell reach the hub within seconds.
    teardown.namespace(HUB, &ns);
    teardown.namespace(cell, &ns);
    deploy::routed_namespace(&env, &[HUB, cell], &ns).await?;
    let (ni, es) = (
        fixtures::resource("networkinterfaces")?,
        fixtures::resource("endpointslices")?,
    );
    for name in ["web-0", "web-1"] {
        fixtures::apply(
            &client,
            &ni,
            &fixtures::network_interface(&ns, name, "default", name, "web", &location),
        )
        .await?;
        fixtures::set_status(&client, &ni, &ns, name, fixtures::bound_status(true)).await?;
    }
    fixtures::apply(
        &client,
        &es,
        &fixtures::galactic_slice(&ns, "pod-0", json!([fixtures::pod_endpoint("fd20::10", "pod-0")]), None),
    )
    .await?;
    let written = Instant::now();
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "web-0", &location),
        COPIES,
        "the first copy",
        |_| true,
    )
    .await?;
    let first_copy_at = applied.elapsed();
    let rules = convergence::default_rules(&["networkinterfaces", "endpointslices"])?;
    let report = convergence::wait_converged(&client, &hub, &ns, &location, &rules, COPIES).await?;
    assert_eq!(
        report.expected,
        BTreeMap::from([("EndpointSlice".to_owned(), 1), ("NetworkInterface".to_owned(), 2)]),
        "{}",
        report.summary()
    );
    eprintln!(
        "copies on the hub {:.2}s after the sources were written (leader {})",
        secs(written.elapsed()),
        leader.name_any()
    );
    eprintln!(
        "timeline: deployment applied +0.0s, secret created +{:.1}s, pods ready +{:.1}s, first copy on hub +{:.1}s",
        secs(secret_at),
        secs(ready_at),
        secs(first_copy_at)
    );
    teardown.finish(&env).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Hand-overs under churn.
// ---------------------------------------------------------------------------------------------

/// The kinds the churn writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Slice,
    Interface,
}

/// A bounded, paced load of creates, updates and deletes of galactic EndpointSlices and
/// NetworkInterfaces in one namespace of a cell, as the drills write.
struct Churn {
    cell: Client,
    ns: String,
    location: String,
    es: ApiResource,
    ni: ApiResource,
    live: BTreeMap<(Kind, usize), u32>,
    /// How often the churn deleted each source (its copy may go as often).
    deleted: BTreeMap<(Kind, usize), usize>,
    rng: StdRng,
    writes: usize,
    failed: Vec<String>,
}

impl Churn {
    fn new(cell: &Client, ns: &str, location: &str) -> anyhow::Result<Churn> {
        let seed = now_ms() as u64;
        eprintln!("churn seed {seed}");
        Ok(Churn {
            cell: cell.clone(),
            ns: ns.to_owned(),
            location: location.to_owned(),
            es: fixtures::resource("endpointslices")?,
            ni: fixtures::resource("networkinterfaces")?,
            live: BTreeMap::new(),
            deleted: BTreeMap::new(),
            rng: StdRng::seed_from_u64(seed),
            writes: 0,
            failed: Vec::new(),
        })
    }

    fn name(kind: Kind, index: usize) -> String {
        match kind {
            Kind::Slice => format!("pod-{index}"),
            Kind::Interface => format!("nic-{index}"),
        }
    }

    fn body(&self, kind: Kind, index: usize, version: u32) -> Value {
        let name = Churn::name(kind, index);
        match kind {
            Kind::Slice => fixtures::galactic_slice(
                &self.ns,
                &name,
                json!([fixtures::pod_endpoint(&format!("fd20::{version:x}"), &name)]),
                None,
            ),
            Kind::Interface => {
                let mut ni = fixtures::network_interface(&self.ns, &name, "default", &name, "web", &self.location);
                ni["spec"]["mtu"] = json!(1300 + version);
                ni
            }
        }
    }

    /// Runs `ops` (distinct objects) at once.
    async fn run(&mut self, ops: Vec<(Kind, usize, Option<u32>)>) {
        let results = futures::future::join_all(ops.iter().map(|&(kind, index, version)| {
            let resource = if kind == Kind::Slice { &self.es } else { &self.ni };
            let body = version.map(|v| self.body(kind, index, v));
            let (cell, ns) = (&self.cell, &self.ns);
            async move {
                match body {
                    Some(body) => fixtures::apply(cell, resource, &body).await.map(drop),
                    None => fixtures::delete(cell, resource, ns, &Churn::name(kind, index)).await,
                }
            }
        }))
        .await;
        for (op, result) in ops.iter().zip(results) {
            self.writes += 1;
            if let Err(e) = result {
                self.failed.push(format!("{op:?}: {e}"));
            }
        }
    }

    /// Creates the first `n` objects of each kind.
    async fn seed(&mut self, n: usize) {
        let mut ops = Vec::new();
        for index in 0..n {
            for kind in [Kind::Slice, Kind::Interface] {
                self.live.insert((kind, index), 1);
                ops.push((kind, index, Some(1)));
            }
        }
        self.run(ops).await;
    }

    /// `n` changes to distinct objects: a create for an absent one; for a live one an update
    /// (3 in 4) or a delete.
    async fn tick(&mut self, n: usize) {
        let mut keys: Vec<(Kind, usize)> = (0..CHURN_POOL)
            .flat_map(|i| [(Kind::Slice, i), (Kind::Interface, i)])
            .collect();
        keys.shuffle(&mut self.rng);
        let mut ops = Vec::new();
        for (kind, index) in keys.into_iter().take(n) {
            let op = match self.live.get(&(kind, index)).copied() {
                None => {
                    self.live.insert((kind, index), 1);
                    (kind, index, Some(1))
                }
                Some(v) if self.rng.random_bool(0.75) => {
                    self.live.insert((kind, index), v + 1);
                    (kind, index, Some(v + 1))
                }
                Some(_) => {
                    self.live.remove(&(kind, index));
                    *self.deleted.entry((kind, index)).or_default() += 1;
                    (kind, index, None)
                }
            };
            ops.push(op);
        }
        self.run(ops).await;
    }

    /// The copy name of every source the churn deleted, and how often it did.
    fn deleted_copies(&self) -> BTreeMap<String, usize> {
        self.deleted
            .iter()
            .map(|(&(kind, index), &n)| (copy_name(&self.ns, &Churn::name(kind, index), &self.location), n))
            .collect()
    }
}

/// Runs the churn, one tick per [`CHURN_TICK`], until `stop` or [`CHURN_MAX_TICKS`].
async fn churn_until(churn: &mut Churn, ticks: &AtomicUsize, stop: &AtomicBool) {
    // Pacing a load generator, not synchronisation: it writes at a steady rate until told.
    let mut interval = tokio::time::interval(CHURN_TICK);
    for _ in 0..CHURN_MAX_TICKS {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        interval.tick().await;
        churn.tick(CHURN_OPS_PER_TICK).await;
        ticks.fetch_add(1, Ordering::Relaxed);
    }
}

async fn wait_ticks(ticks: &AtomicUsize, n: usize) -> anyhow::Result<()> {
    let deadline = CHURN_TICK * (n as u32) * 4 + Duration::from_secs(30);
    wait::until(deadline, &format!("{n} churn ticks"), || {
        let done = ticks.load(Ordering::Relaxed);
        async move { Ok::<_, String>((done >= n).then_some(())) }
    })
    .await?;
    Ok(())
}

fn churn_rules() -> anyhow::Result<Vec<Rule>> {
    Ok(convergence::default_rules(&["endpointslices", "networkinterfaces"])?)
}

/// Records, from watches, every copy of a location deleted on the hub, every holder of its
/// Lease, and when each of its pods' deletion was requested.
struct Recorder {
    deleted_copies: Arc<Mutex<Vec<String>>>,
    holders: Arc<Mutex<Vec<Holder>>>,
    /// Pod name → when its deletion was requested (ms since the epoch): `deletionTimestamp`
    /// minus the grace period, since a pod's deletionTimestamp is when its grace period ends.
    deletion_requested: Arc<Mutex<BTreeMap<String, i64>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Recorder {
    async fn start(env: &Environment, cell: Cluster, ns: &str, location: &str) -> anyhow::Result<Recorder> {
        let hub = env.client(HUB).await?;
        let cell_client = env.client(cell).await?;
        let synced = Arc::new(AtomicUsize::new(0));
        let mut recorder = Recorder {
            deleted_copies: Arc::default(),
            holders: Arc::default(),
            deletion_requested: Arc::default(),
            tasks: Vec::new(),
        };
        let copies = format!("{LOCATION_LABEL}={location}");
        for rule in churn_rules()? {
            let api = Api::<DynamicObject>::namespaced_with(hub.clone(), ns, &rule.resource.api_resource());
            let (seen, synced) = (Arc::clone(&recorder.deleted_copies), Arc::clone(&synced));
            let config = watcher::Config::default().labels(&copies);
            recorder.tasks.push(tokio::spawn(async move {
                let mut events = watcher::watcher(api, config).default_backoff().boxed();
                while let Some(event) = events.next().await {
                    match event {
                        Ok(watcher::Event::Delete(o)) => seen.lock().unwrap().push(o.name_any()),
                        Ok(watcher::Event::InitDone) => {
                            synced.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
            }));
        }
        let leases = Api::<Lease>::namespaced(hub.clone(), SYSTEM_NAMESPACE);
        let config = watcher::Config::default().fields(&format!("metadata.name={}", deploy::lease_name(location)));
        let (holders, lease_synced) = (Arc::clone(&recorder.holders), Arc::clone(&synced));
        recorder.tasks.push(tokio::spawn(async move {
            let mut events = watcher::watcher(leases, config).default_backoff().boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                        if let Some(h) = deploy::holder(&lease) {
                            let mut holders = holders.lock().unwrap();
                            if holders.last().is_none_or(|last| last.identity != h.identity) {
                                holders.push(h);
                            }
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        lease_synced.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
        }));
        let pods = Api::<Pod>::namespaced(cell_client, SYSTEM_NAMESPACE);
        let config = watcher::Config::default().labels(CELL_SELECTOR);
        let (requested, pods_synced) = (Arc::clone(&recorder.deletion_requested), Arc::clone(&synced));
        recorder.tasks.push(tokio::spawn(async move {
            let mut events = watcher::watcher(pods, config).default_backoff().boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) | watcher::Event::Delete(pod)) => {
                        if let Some(at) = &pod.metadata.deletion_timestamp {
                            let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or_default();
                            requested
                                .lock()
                                .unwrap()
                                .entry(pod.name_any())
                                .or_insert(at.0.as_millisecond() - grace * 1000);
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        pods_synced.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
        }));
        let watches = recorder.tasks.len();
        wait::until(WATCH_SYNCED, "the recording watches to list", || {
            let n = synced.load(Ordering::Relaxed);
            async move { Ok::<_, String>((n >= watches).then_some(())) }
        })
        .await?;
        Ok(recorder)
    }

    fn holders(&self) -> Vec<Holder> {
        self.holders.lock().unwrap().clone()
    }

    /// Checks that no copy was deleted on the hub but for a delete of its source: each copy
    /// went at most as often as the churn deleted its source.
    fn assert_no_copy_wrongly_deleted(&self, churn: &Churn) {
        let mut deleted: BTreeMap<String, usize> = BTreeMap::new();
        for name in self.deleted_copies.lock().unwrap().iter() {
            *deleted.entry(name.clone()).or_default() += 1;
        }
        let allowed = churn.deleted_copies();
        let wrong: Vec<String> = deleted
            .iter()
            .filter(|(name, n)| **n > allowed.get(*name).copied().unwrap_or(0))
            .map(|(name, n)| {
                format!(
                    "{name} deleted {n} times, its source {} times",
                    allowed.get(name).copied().unwrap_or(0)
                )
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "copies deleted without a delete of their source: {wrong:?}"
        );
        eprintln!(
            "{} copy deletions on the hub, none beyond the churn's {} source deletes; {} writes in the cell",
            deleted.values().sum::<usize>(),
            allowed.values().sum::<usize>(),
            churn.writes
        );
    }
}

/// What a hand-over scenario needs once deployed and seeded.
struct UnderChurn {
    deployed: Deployed,
    ns: String,
    cell: Client,
    hub: Client,
    churn: Churn,
}

async fn deploy_and_seed(
    env: &Environment,
    cell: Cluster,
    location: &str,
    teardown: &mut Teardown,
) -> anyhow::Result<UnderChurn> {
    let ns = unique("churn");
    teardown.namespace(HUB, &ns);
    teardown.namespace(cell, &ns);
    deploy::routed_namespace(env, &[HUB, cell], &ns).await?;
    let deployed = deploy_location(env, cell, location, teardown).await?;
    let (cell_client, hub) = (env.client(cell).await?, env.client(HUB).await?);
    let mut churn = Churn::new(&cell_client, &ns, location)?;
    churn.seed(CHURN_SEED).await;
    ensure!(churn.failed.is_empty(), "seeding failed: {:?}", churn.failed);
    let report = convergence::wait_converged(&cell_client, &hub, &ns, location, &churn_rules()?, AFTER_FAULT).await?;
    eprintln!("seeded: {}", report.summary());
    Ok(UnderChurn {
        deployed,
        ns,
        cell: cell_client,
        hub,
        churn,
    })
}

/// After the fault: the cell took every change, the hub matches it exactly, and no copy was
/// deleted but those of deleted sources.
async fn assert_nothing_lost(run: &UnderChurn, recorder: &Recorder) -> anyhow::Result<()> {
    let churn = &run.churn;
    assert!(
        churn.failed.is_empty(),
        "the cell took every change: {:?}",
        churn.failed
    );
    let t = Instant::now();
    let report = convergence::wait_converged(
        &run.cell,
        &run.hub,
        &run.ns,
        &run.deployed.location,
        &churn_rules()?,
        AFTER_FAULT,
    )
    .await?;
    eprintln!(
        "converged {:.1}s after the churn stopped: {}",
        secs(t.elapsed()),
        report.summary()
    );
    assert_eq!(
        report.expected_total(),
        churn.live.len(),
        "the hub holds a copy of every live source"
    );
    recorder.assert_no_copy_wrongly_deleted(churn);
    Ok(())
}

#[tokio::test]
async fn leader_pod_deleted_under_churn() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let cell = CELL_B;
    let location = unique("podkill");
    deploy::require_free(&env, cell).await?;
    let mut teardown = Teardown::new(&env, &[&location]).await?;
    teardown.cell(cell);
    let mut run = deploy_and_seed(&env, cell, &location, &mut teardown).await?;
    let leader = holding_pod(&run.deployed.leader, &run.deployed.pods)?.name_any();
    let standby = names(&run.deployed.pods)
        .into_iter()
        .find(|p| *p != leader)
        .context("no standby")?;
    let recorder = Recorder::start(&env, cell, &run.ns, &location).await?;

    let (ticks, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let cell_client = run.cell.clone();
    let hub = run.hub.clone();
    let fault = async {
        let result = async {
            wait_ticks(&ticks, CHURN_TICKS_BEFORE).await?;
            let t = Instant::now();
            env.kubectl_ok(
                cell,
                ["-n", SYSTEM_NAMESPACE, "delete", "pod", leader.as_str(), "--wait=false"],
            )
            .await?;
            let standby_set = BTreeSet::from([standby.clone()]);
            let took_over = wait_leader(&hub, &location, &standby_set, LEASE_DURATION)
                .await
                .context("the standby did not take over within the Lease duration")?;
            let took = t.elapsed();
            let pods = deploy::wait_pods_ready(&cell_client, CELL_SELECTOR, 2, PODS_READY).await?;
            assert!(!names(&pods).contains(&leader), "the deleted leader is gone");
            let at = ticks.load(Ordering::Relaxed);
            wait_ticks(&ticks, at + CHURN_TICKS_AFTER).await?;
            anyhow::Ok((took, took_over, pods))
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        result
    };
    let ((), outcome) = tokio::join!(churn_until(&mut run.churn, &ticks, &stop), fault);
    let (took, took_over, pods) = outcome?;
    eprintln!(
        "leader pod {leader} deleted: standby {standby} holds the Lease {:.2}s later (bound {}s); {} churn ticks",
        secs(took),
        LEASE_DURATION.as_secs(),
        ticks.load(Ordering::Relaxed)
    );
    assert_eq!(took_over.identity, standby, "a replica's identity is its pod name");
    assert_nothing_lost(&run, &recorder).await?;
    let holder = deploy::lease_holder(&run.hub, &location).await?.context("no holder")?;
    assert_eq!(holder.identity, took_over.identity, "the standby kept leading");
    assert!(pods.iter().any(|p| p.name_any() == standby));
    drop(recorder);
    teardown.finish(&env).await?;
    Ok(())
}

#[tokio::test]
async fn rollout_restart_under_churn() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let cell = CELL_A;
    let location = unique("rollout");
    deploy::require_free(&env, cell).await?;
    let mut teardown = Teardown::new(&env, &[&location]).await?;
    teardown.cell(cell);
    let mut run = deploy_and_seed(&env, cell, &location, &mut teardown).await?;
    let old_pods = names(&run.deployed.pods);
    let recorder = Recorder::start(&env, cell, &run.ns, &location).await?;
    let deployments = Api::<Deployment>::namespaced(run.cell.clone(), SYSTEM_NAMESPACE);

    let (ticks, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let cell_client = run.cell.clone();
    let fault = async {
        let result = async {
            wait_ticks(&ticks, CHURN_TICKS_BEFORE).await?;
            let t = Instant::now();
            env.kubectl_ok(
                cell,
                ["-n", SYSTEM_NAMESPACE, "rollout", "restart", "deployment/replicator"],
            )
            .await?;
            let pods = wait::until_observed(ROLLOUT, "the rollout to replace both pods", || async {
                let d = deployments.get(deploy::DEPLOYMENT).await?;
                let status = d.status.clone().unwrap_or_default();
                let pods = deploy::pods(&cell_client, CELL_SELECTOR).await?;
                let done = d
                    .metadata
                    .generation
                    .is_some_and(|g| status.observed_generation >= Some(g))
                    && status.updated_replicas == Some(2)
                    && status.ready_replicas == Some(2)
                    && status.replicas == Some(2)
                    && pods.len() == 2
                    && pods.iter().all(|p| {
                        deploy::is_ready(p) && !deploy::is_terminating(p) && !old_pods.contains(&p.name_any())
                    });
                Ok::<_, replicator_e2e::Error>(if done {
                    Check::Ready(pods)
                } else {
                    Check::NotYet(deploy::describe_pods(&pods))
                })
            })
            .await?;
            let took = t.elapsed();
            let at = ticks.load(Ordering::Relaxed);
            wait_ticks(&ticks, at + CHURN_TICKS_AFTER).await?;
            anyhow::Ok((took, pods))
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        result
    };
    let ((), outcome) = tokio::join!(churn_until(&mut run.churn, &ticks, &stop), fault);
    let (took, pods) = outcome?;
    eprintln!(
        "rollout restart replaced both pods in {:.1}s; {} churn ticks",
        secs(took),
        ticks.load(Ordering::Relaxed)
    );
    let new_pods = names(&pods);
    let holder = wait_leader(&run.hub, &location, &new_pods, LEASE_DURATION).await?;

    // Every hand-over: the holder's pod was being deleted, and the next holder acquired the
    // Lease within RELEASE_HANDOVER of that request (it was released, not left to expire).
    let holders = recorder.holders();
    let requested = recorder.deletion_requested.lock().unwrap().clone();
    eprintln!("holders: {:?}", holders.iter().map(|h| &h.identity).collect::<Vec<_>>());
    ensure!(holders.len() >= 2, "the Lease changed hands: {holders:?}");
    for pair in holders.windows(2) {
        let (from, to) = (&pair[0], &pair[1]);
        let deleted = *requested
            .get(from.pod())
            .with_context(|| format!("{} handed over without its pod being deleted", from.identity))?;
        let acquired = to
            .acquired_ms
            .with_context(|| format!("{} has no acquireTime", to.identity))?;
        let after = Duration::from_millis(u64::try_from(acquired - deleted).unwrap_or_default());
        eprintln!(
            "hand-over {} -> {}: acquired {:.2}s after the old leader's deletion was requested (bound {}s)",
            from.identity,
            to.identity,
            (acquired - deleted) as f64 / 1000.0,
            RELEASE_HANDOVER.as_secs()
        );
        assert!(
            after <= RELEASE_HANDOVER,
            "{} acquired the Lease {after:?} after {}'s deletion was requested",
            to.identity,
            from.pod()
        );
    }
    assert_eq!(holders.last().map(|h| &h.identity), Some(&holder.identity));
    assert_nothing_lost(&run, &recorder).await?;
    drop(recorder);
    teardown.finish(&env).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. The README's deployment: both cells, and membership on the hub's host.
// ---------------------------------------------------------------------------------------------

async fn service_status(hub: &Client, ns: &str, name: &str) -> Value {
    Api::<NetworkService>::namespaced(hub.clone(), ns)
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .map(|s| serde_json::to_value(s.status).unwrap_or(Value::Null))
        .unwrap_or(Value::Null)
}

/// The `ready` condition of the endpoint with `address` in the service's slices.
async fn endpoint_ready(hub: &Client, ns: &str, service: &str, address: &str) -> anyhow::Result<Option<bool>> {
    let slices = Api::<EndpointSlice>::namespaced(hub.clone(), ns)
        .list(&ListParams::default().labels(&format!("networking.datumapis.com/network-service={service}")))
        .await?;
    Ok(slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter())
        .find(|e| e.addresses.iter().any(|a| a == address))
        .and_then(|e| e.conditions.as_ref())
        .and_then(|c| c.ready))
}

async fn wait_member(hub: &Client, ns: &str, healthy: u64, address: &str, ready: bool) -> anyhow::Result<Value> {
    let what = format!("NetworkService web: {healthy} healthy, endpoint {address} ready={ready}");
    Ok(wait::until_observed(MEMBERSHIP, &what, || async {
        let status = service_status(hub, ns, "web").await;
        let endpoint = endpoint_ready(hub, ns, "web", address).await?;
        Ok::<_, anyhow::Error>(if status["summary"]["healthy"] == healthy && endpoint == Some(ready) {
            Check::Ready(status)
        } else {
            Check::NotYet(format!("summary {}; endpoint ready {endpoint:?}", status["summary"]))
        })
    })
    .await?)
}

#[tokio::test]
async fn readme_deploy_both_cells_and_membership() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let image = image()?;
    let sites = [(CELL_A, "dfw", 1u8), (CELL_B, "sjc", 2u8)];
    for (cell, _, _) in sites {
        deploy::require_free(&env, cell).await?;
    }
    let mut teardown = Teardown::new(&env, &["dfw", "sjc"]).await?;
    let hub = env.client(HUB).await?;
    let started = Instant::now();

    // The README's order: CRDs and RBAC on the hub, membership on the hub's host (cell-b here),
    // then per cell the CRDs, the overlay and the Secret it mounts.
    deploy::apply(&env, HUB, &deploy::config_dir("crds")).await?;
    deploy::apply_hub_rbac_for(&env, &mut teardown, &["dfw", "sjc"]).await?;
    let membership = deploy::write_overlay("membership", Base::Membership, &image)?;
    teardown.path(&membership);
    teardown.applied(CELL_B, &membership);
    deploy::apply(&env, CELL_B, &membership).await?;
    let kubeconfig = membership.join("hub.kubeconfig");
    deploy::write_hub_kubeconfig(&env, deploy::MEMBERSHIP_SERVICE_ACCOUNT, &kubeconfig).await?;
    deploy::create_secret(&env, CELL_B, MEMBERSHIP_SECRET, &kubeconfig).await?;
    for (cell, location, _) in sites {
        deploy::apply(&env, cell, &deploy::config_dir("crds")).await?;
        let overlay = deploy::write_overlay(location, Base::Overlay(location), &image)?;
        teardown.path(&overlay);
        teardown.applied(cell, &overlay);
        deploy::apply(&env, cell, &overlay).await?;
        let kubeconfig = overlay.join("hub.kubeconfig");
        deploy::write_hub_kubeconfig(&env, &deploy::run_service_account(location), &kubeconfig).await?;
        deploy::create_secret(&env, cell, HUB_SECRET, &kubeconfig).await?;
    }
    for (cell, location, _) in sites {
        let client = env.client(cell).await?;
        let pods = deploy::wait_pods_ready(&client, CELL_SELECTOR, 2, PODS_READY).await?;
        let holder = wait_leader(&hub, location, &names(&pods), LEASE_DURATION).await?;
        eprintln!(
            "{location} in {cell}: pods {:?}, Lease held by {}",
            names(&pods),
            holder.identity
        );
    }
    let membership_pods =
        deploy::wait_pods_ready(&env.client(CELL_B).await?, MEMBERSHIP_SELECTOR, 2, PODS_READY).await?;
    eprintln!(
        "deployed and Ready in {:.1}s (membership pod {})",
        secs(started.elapsed()),
        membership_pods[0].name_any()
    );

    // The demo's sample input, written into both cells, reaches the hub from both locations.
    let ns = unique("readme");
    for cluster in [HUB, CELL_A, CELL_B] {
        teardown.namespace(cluster, &ns);
    }
    deploy::routed_namespace(&env, &[HUB, CELL_A, CELL_B], &ns).await?;
    let rules = convergence::default_rules(&fixtures::SAMPLE_RULES)?;
    for (cell, location, site) in sites {
        let client = env.client(cell).await?;
        fixtures::sample_input(&client, &ns, location, site).await?;
        let report = convergence::wait_converged(&client, &hub, &ns, location, &rules, COPIES).await?;
        eprintln!("{location}: {}", report.summary());
        assert_eq!(
            report.expected,
            BTreeMap::from(
                [
                    ("EndpointSlice", 2),
                    ("Network", 1),
                    ("NetworkContext", 1),
                    ("NetworkInterface", 2),
                    ("Subnet", 1)
                ]
                .map(|(k, n)| (k.to_owned(), n))
            ),
            "{location}: {}",
            report.summary()
        );
        assert_eq!(report.held, 1, "{location}: the empty slice is held");
    }

    // A NetworkService on the hub: status and slices from the deployed `replicator membership`,
    // following a member's HolderAvailable as the cell's source reports it.
    let services = fixtures::network_service_resource();
    fixtures::apply(&hub, &services, &fixtures::network_service(&ns, "web", "web")).await?;
    let address = "fd20:0:1:1::10";
    let status = wait_member(&hub, &ns, 4, address, true).await?;
    assert_eq!(status["summary"]["members"], 4, "{status}");
    assert_eq!(status["summary"]["locations"], 2, "{status}");
    let (cell_a, ni) = (env.client(CELL_A).await?, fixtures::resource("networkinterfaces")?);
    let flipped = Instant::now();
    fixtures::set_status(&cell_a, &ni, &ns, "web-0-eth0", fixtures::bound_status(false)).await?;
    let status = wait_member(&hub, &ns, 3, address, false).await?;
    eprintln!(
        "HolderAvailable False on dfw/web-0-eth0: healthy 3 and its endpoint unready on the hub after {:.1}s",
        secs(flipped.elapsed())
    );
    assert_eq!(status["summary"]["members"], 4, "{status}");
    let flipped = Instant::now();
    fixtures::set_status(&cell_a, &ni, &ns, "web-0-eth0", fixtures::bound_status(true)).await?;
    wait_member(&hub, &ns, 4, address, true).await?;
    eprintln!(
        "HolderAvailable True again: healthy 4 and the endpoint ready after {:.1}s",
        secs(flipped.elapsed())
    );
    teardown.finish(&env).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. A broken hub Secret: unready, nothing written or withdrawn, fixed without a manual step.
// ---------------------------------------------------------------------------------------------

/// `replicator_errors_total` of `location` and `class`, summed over kinds.
fn errors(text: &str, location: &str, class: &str) -> f64 {
    metrics::parse(text)
        .iter()
        .filter(|s| {
            s.name == "replicator_errors_total"
                && s.label("location") == Some(location)
                && s.label("class") == Some(class)
        })
        .map(|s| s.value)
        .sum()
}

/// One way to break the hub kubeconfig.
struct Broken {
    name: &'static str,
    server: String,
    token: String,
    /// The error class the hub failures are counted under.
    class: &'static str,
    /// Text the log line reports the failure with.
    reason: &'static str,
}

#[tokio::test]
async fn bad_hub_secret_keeps_pods_unready_until_fixed() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let cell = CELL_B;
    let (location, ns) = (unique("badhub"), unique("badhubsrc"));
    deploy::require_free(&env, cell).await?;
    let mut teardown = Teardown::new(&env, &[&location]).await?;
    teardown.cell(cell);
    teardown.namespace(HUB, &ns);
    teardown.namespace(cell, &ns);
    deploy::routed_namespace(&env, &[HUB, cell], &ns).await?;
    let deployed = deploy_location(&env, cell, &location, &mut teardown).await?;
    let (client, hub) = (env.client(cell).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    let interface = |name: &str| fixtures::network_interface(&ns, name, "default", name, "web", &location);

    // A copy published while the Secret was good: it must survive what follows.
    fixtures::apply(&client, &ni, &interface("published")).await?;
    let published = copy_name(&ns, "published", &location);
    let before = fixtures::wait_for(&hub, &ni, &ns, &published, COPIES, "the first copy", |_| true).await?;

    let host = env.host_address().await?;
    let closed_port = std::net::TcpListener::bind((host, 0))?.local_addr()?.port();
    let cases = [
        Broken {
            name: "wrong server",
            server: format!("https://{host}:{closed_port}"),
            token: env
                .service_account_token(HUB, SYSTEM_NAMESPACE, &deploy::run_service_account(&location), "1h")
                .await?,
            class: "unreachable",
            reason: "Connection refused",
        },
        Broken {
            name: "rejected token",
            server: env.pod_reachable_server_url(HUB).await?,
            token: "not-a-token-the-hub-knows".to_owned(),
            class: "forbidden",
            reason: "Unauthorized",
        },
    ];
    let mut failed_recoveries = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        eprintln!("== {}: {}", case.name, case.server);
        // The pods start over on the broken Secret (their process reads the file at start).
        env.kubectl_ok(
            cell,
            ["-n", SYSTEM_NAMESPACE, "delete", "deployment", deploy::DEPLOYMENT],
        )
        .await?;
        deploy::wait_pods_gone(&client, CELL_SELECTOR, PODS_GONE).await?;
        let broken = deployed.overlay.join(format!("hub-broken-{i}.kubeconfig"));
        deploy::write_kubeconfig(&env, &case.server, &case.token, &broken).await?;
        deploy::replace_secret(&env, cell, HUB_SECRET, &broken).await?;
        deploy::apply(&env, cell, &deployed.overlay).await?;

        // Running, unready, saying why in the log and on /metrics.
        let what = format!("both pods running, unready, reporting the hub failure ({})", case.name);
        let (pods, line) = wait::until_observed(HUB_FAILURE_REPORTED, &what, || async {
            let pods = deploy::pods(&client, CELL_SELECTOR).await?;
            if pods.len() != 2 || !pods.iter().all(deploy::is_running) {
                return Ok::<_, anyhow::Error>(Check::NotYet(deploy::describe_pods(&pods)));
            }
            let mut line = String::new();
            for pod in &pods {
                let log = deploy::logs(&env, cell, &pod.name_any(), false).await?;
                let Some(found) = log
                    .lines()
                    .find(|l| l.contains("\"cluster\":\"hub\"") && l.contains(case.reason))
                else {
                    return Ok(Check::NotYet(format!(
                        "{}: no hub failure in its log yet",
                        pod.name_any()
                    )));
                };
                let metrics = deploy::scrape_metrics(pod).await?;
                let count = errors(&metrics, &location, case.class);
                if count < 1.0 {
                    return Ok(Check::NotYet(format!(
                        "{}: {} errors {count}",
                        pod.name_any(),
                        case.class
                    )));
                }
                if case.class == "unreachable"
                    && metrics::metric_value(&metrics, "replicator_hub_up", &[("location", location.as_str())])
                        != Some(0.0)
                {
                    return Ok(Check::NotYet(format!("{}: replicator_hub_up not 0", pod.name_any())));
                }
                let (status, problems) = deploy::readyz(pod).await?;
                if status != 503 || !problems.contains("hub") {
                    return Ok(Check::NotYet(format!(
                        "{}: /readyz {status} {problems}",
                        pod.name_any()
                    )));
                }
                line = format!("{found}\n/readyz {status}: {}", problems.trim());
            }
            Ok(Check::Ready((pods, line)))
        })
        .await?;
        eprintln!("log: {line}");
        let started = names(&pods);

        // Meanwhile nothing is written (a new source gets no copy) and nothing withdrawn.
        let during = format!("during-{i}");
        fixtures::apply(&client, &ni, &interface(&during)).await?;
        let during_copy = copy_name(&ns, &during, &location);
        deploy::stays(
            BROKEN_OBSERVED,
            "pods unready, no new copy, the published copy kept",
            || async {
                let pods = deploy::pods(&client, CELL_SELECTOR).await?;
                let unready = names(&pods) == started
                    && pods
                        .iter()
                        .all(|p| deploy::condition(p, "Ready") == Some("False") && deploy::restart_count(p) == 0);
                let new_copy = fixtures::get(&hub, &ni, &ns, &during_copy).await?;
                let kept = fixtures::get(&hub, &ni, &ns, &published).await?;
                let kept_same = kept.as_ref().is_some_and(|k| k.uid() == before.uid());
                Ok::<_, replicator_e2e::Error>(if unready && new_copy.is_none() && kept_same {
                    Check::Ready(())
                } else {
                    Check::NotYet(format!(
                        "{}; new copy {}; published copy {}",
                        deploy::describe_pods(&pods),
                        new_copy.is_some(),
                        if kept_same { "kept" } else { "gone or replaced" }
                    ))
                })
            },
        )
        .await?;
        let metrics = deploy::scrape_metrics(&pods[0]).await?;
        eprintln!(
            "{}: replicator_errors_total{{class=\"{}\"}} {} on {}",
            case.name,
            case.class,
            errors(&metrics, &location, case.class),
            pods[0].name_any()
        );

        // Fixed: the same pods become Ready (each restarted once, by the process itself on the
        // changed file), and the copy appears.
        let fixed = Instant::now();
        deploy::replace_secret(&env, cell, HUB_SECRET, &deployed.kubeconfig).await?;
        let recovered = deploy::wait_pods_ready(&client, CELL_SELECTOR, 2, SECRET_FIXED).await;
        let recovered = match recovered {
            Ok(pods) => pods,
            Err(e) => {
                let pods = deploy::pods(&client, CELL_SELECTOR).await?;
                let tail = match pods.first() {
                    Some(p) => deploy::logs(&env, cell, &p.name_any(), false).await.unwrap_or_default(),
                    None => String::new(),
                };
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                eprintln!(
                    "{}: no recovery after the Secret was fixed: {e}\nlast log lines (newest first): {tail:#?}",
                    case.name
                );
                failed_recoveries.push(format!("{}: {e}", case.name));
                continue;
            }
        };
        eprintln!(
            "{}: Ready {:.1}s after the Secret was fixed; restarts {:?}",
            case.name,
            secs(fixed.elapsed()),
            recovered
                .iter()
                .map(|p| (p.name_any(), deploy::restart_count(p)))
                .collect::<Vec<_>>()
        );
        assert_eq!(names(&recovered), started, "the same pods recovered: no manual step");
        for pod in &recovered {
            assert_eq!(
                deploy::restart_count(pod),
                1,
                "{}: the process exited on the changed kubeconfig and the kubelet restarted it once",
                pod.name_any()
            );
        }
        fixtures::wait_for(&hub, &ni, &ns, &during_copy, COPIES, "the copy made once fixed", |_| {
            true
        })
        .await?;
        let kept = fixtures::get(&hub, &ni, &ns, &published)
            .await?
            .context("published copy")?;
        assert_eq!(kept.uid(), before.uid(), "the published copy was never withdrawn");
    }
    ensure!(failed_recoveries.is_empty(), "{failed_recoveries:?}");
    teardown.finish(&env).await?;
    Ok(())
}
