//! Failure drills (issue 6) on the real local control plane: a fault is injected while a cell
//! changes, and each drill asserts that the hub converges with nothing lost and nothing
//! resurrected. "Converged" is checked by [`replicator_e2e::convergence`]: every source in the
//! cell has exactly its correct copy (the product's own plan, compared with `in_sync`), no copy
//! of the location lacks a source, and deleted sources stay deleted. Each drill prints
//! `drill <name>: converged in X.Ys` (from the end of the fault) for the record.
//!
//! The replicators run as the least-privilege service accounts (the harness's default), so the
//! drills also prove the shipped RBAC under faults.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::discovery::ApiResource;
use kube::{Api, Client, ResourceExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replicator::api_errors::ErrorClass;
use replicator::copy::copy_name;
use replicator::rules::Rule;
use replicator_e2e::{
    CELL_A, CELL_B, Environment, HUB, ReplicatorProcess, ReplicatorSpec, convergence,
    fault_proxy::FaultProxy,
    fixtures::{self, CONVERGE, unique},
    rbac, wait,
};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// How long the hub may take to converge after a fault ends (relists, backoffs, Karmada restart).
const AFTER_FAULT: Duration = Duration::from_secs(180);

/// Prints the figure the drill is quoted by.
fn announce(drill: &str, took: Duration) {
    eprintln!("drill {drill}: converged in {:.2}s", took.as_secs_f64());
}

/// Prints a test's wall time when dropped, pass or fail.
struct WallTime(&'static str, Instant);

impl WallTime {
    fn start(test: &'static str) -> WallTime {
        WallTime(test, Instant::now())
    }

    /// Prints how far into the test a phase ended, to see where the wall time goes.
    fn phase(&self, what: &str) {
        eprintln!("  [{} +{:.1}s] {what}", self.0, self.1.elapsed().as_secs_f64());
    }
}

impl Drop for WallTime {
    fn drop(&mut self) {
        eprintln!("test {} took {:.1}s", self.0, self.1.elapsed().as_secs_f64());
    }
}

async fn start(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(90)).await.unwrap();
    process
}

/// Creates routed namespace `ns` in the hub and in `cell` directly, kept from Karmada's namespace
/// propagation: a drill depends on no delivery, and deleting its hub namespace (the terminating
/// drill does) must not delete the cell's, whose sources stay.
async fn drill_namespace(env: &Environment, cell: replicator_e2e::Cluster, ns: &str) {
    let labels = json!({
        replicator::routing::UPSTREAM_CLUSTER_LABEL: fixtures::UPSTREAM_CLUSTER,
        replicator::routing::UPSTREAM_NAMESPACE_LABEL: "default",
        rbac::KARMADA_SKIP_PROPAGATION_LABEL: "true",
    });
    for cluster in [HUB, cell] {
        let api = Api::<Namespace>::all(env.client(cluster).await.unwrap());
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns, "labels": labels}})).unwrap();
        match api.create(&PostParams::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("creating namespace {ns} in {cluster}: {e}"),
        }
    }
}

/// Removes what a drill leaves behind when dropped, pass or fail, so that later replicators of
/// the cell do not mirror it again: the drill's sources in the cell, every copy its location
/// published on the hub, and its hub namespaces (the namespace controller empties them; Karmada
/// then withdraws what it delivered from them).
struct Tidy {
    cell: std::path::PathBuf,
    hub: std::path::PathBuf,
    namespaces: Vec<String>,
    location: String,
}

impl Tidy {
    fn new(env: &Environment, cell: replicator_e2e::Cluster, namespaces: &[&str], location: &str) -> Tidy {
        Tidy {
            cell: env.kubeconfig_path(cell),
            hub: env.kubeconfig_path(HUB),
            namespaces: namespaces.iter().map(|n| (*n).to_owned()).collect(),
            location: location.to_owned(),
        }
    }
}

impl Drop for Tidy {
    fn drop(&mut self) {
        let (cell, hub, namespaces, location) = (
            self.cell.clone(),
            self.hub.clone(),
            self.namespaces.clone(),
            self.location.clone(),
        );
        // Drop cannot await: a thread with a runtime of its own does the work.
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime
                .block_on(tidy(&cell, &hub, &namespaces, &location))
                .map_err(|e| e.to_string())
        })
        .join();
        if let Ok(Err(e)) = done {
            eprintln!("tidying up after the drill failed: {e}");
        }
    }
}

async fn tidy(
    cell: &std::path::Path,
    hub: &std::path::Path,
    namespaces: &[String],
    location: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let (cell, hub) = (
        replicator_e2e::kubeconfig::client(cell).await?,
        replicator_e2e::kubeconfig::client(hub).await?,
    );
    let copies = ListParams::default().labels(&format!("{}={location}", replicator::rules::LOCATION_LABEL));
    // The hub namespaces go first: the namespace controller empties them of this location's
    // copies (and everything else) while the rest runs.
    let hub_ns = Api::<Namespace>::all(hub.clone());
    for ns in namespaces {
        match hub_ns.delete(ns, &DeleteParams::default()).await {
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut deletes = Vec::new();
    for rule in replicator::rules::default_rules() {
        let resource = rule.resource.api_resource();
        for ns in namespaces {
            deletes.push((cell.clone(), ns.clone(), resource.clone(), ListParams::default()));
        }
        // Copies of this location elsewhere: of sources other scenarios left in the cell.
        let on_hub = Api::<DynamicObject>::all_with(hub.clone(), &resource)
            .list_metadata(&copies)
            .await?;
        let elsewhere: std::collections::BTreeSet<String> = on_hub
            .items
            .iter()
            .filter_map(|c| c.namespace())
            .filter(|ns| !namespaces.contains(ns))
            .collect();
        for ns in elsewhere {
            deletes.push((hub.clone(), ns, resource.clone(), copies.clone()));
        }
    }
    futures::future::try_join_all(deletes.into_iter().map(|(client, ns, resource, selector)| async move {
        Api::<DynamicObject>::namespaced_with(client, &ns, &resource)
            .delete_collection(&DeleteParams::default(), &selector)
            .await
            .map(|_| ())
    }))
    .await?;
    Ok(())
}

async fn metric(r: &ReplicatorProcess, name: &str, labels: &[(&str, &str)]) -> f64 {
    r.counter(name, labels).await.unwrap()
}

// ---------------------------------------------------------------------------------------------
// Churn: creates, updates and deletes of galactic EndpointSlices and NetworkInterfaces.
// ---------------------------------------------------------------------------------------------

/// The two kinds the churn writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Slice,
    Interface,
}

/// One write of the churn.
#[derive(Clone, Copy, Debug)]
enum Write {
    /// Server-side apply of version `v` (a create if the object is absent).
    Apply(u32),
    Delete,
}

#[derive(Clone, Copy, Debug)]
struct Op {
    kind: Kind,
    index: usize,
    write: Write,
}

/// The pool of sources the churn draws from, and what it believes is live.
struct Churn {
    ns: String,
    location: String,
    size: usize,
    live: BTreeMap<(Kind, usize), u32>,
    rng: StdRng,
}

/// What a run of the churn did.
#[derive(Debug, Default, Clone)]
struct ChurnStats {
    applied: usize,
    deleted: usize,
    failed: usize,
    /// The first failure, for the report.
    first_error: Option<String>,
}

impl ChurnStats {
    fn add(&mut self, other: ChurnStats) {
        self.applied += other.applied;
        self.deleted += other.deleted;
        self.failed += other.failed;
        self.first_error = self.first_error.take().or(other.first_error);
    }
}

impl Churn {
    fn new(ns: &str, location: &str, size: usize) -> Churn {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(7);
        eprintln!("churn seed {seed}");
        Churn {
            ns: ns.to_owned(),
            location: location.to_owned(),
            size,
            live: BTreeMap::new(),
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Creates of the first `n` names of each kind.
    fn seed(&mut self, n: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        for index in 0..n.min(self.size) {
            for kind in [Kind::Slice, Kind::Interface] {
                self.live.insert((kind, index), 1);
                ops.push(Op {
                    kind,
                    index,
                    write: Write::Apply(1),
                });
            }
        }
        ops
    }

    /// `n` random changes: a create for an absent name; for a live one an update (3 in 4) or a
    /// delete.
    fn random(&mut self, n: usize) -> Vec<Op> {
        (0..n)
            .map(|_| {
                let kind = if self.rng.random_bool(0.5) {
                    Kind::Slice
                } else {
                    Kind::Interface
                };
                let index = self.rng.random_range(0..self.size);
                let write = match self.live.get(&(kind, index)).copied() {
                    None => {
                        self.live.insert((kind, index), 1);
                        Write::Apply(1)
                    }
                    Some(v) if self.rng.random_bool(0.75) => {
                        self.live.insert((kind, index), v + 1);
                        Write::Apply(v + 1)
                    }
                    Some(_) => {
                        self.live.remove(&(kind, index));
                        Write::Delete
                    }
                };
                Op { kind, index, write }
            })
            .collect()
    }

    fn runner(&self, cell: &Client) -> Runner {
        Runner {
            cell: cell.clone(),
            ns: self.ns.clone(),
            location: self.location.clone(),
            es: fixtures::resource("endpointslices").unwrap(),
            ni: fixtures::resource("networkinterfaces").unwrap(),
        }
    }
}

/// Executes churn ops against a cell.
#[derive(Clone)]
struct Runner {
    cell: Client,
    ns: String,
    location: String,
    es: ApiResource,
    ni: ApiResource,
}

impl Runner {
    fn name(kind: Kind, index: usize) -> String {
        match kind {
            Kind::Slice => format!("pod-{index}"),
            Kind::Interface => format!("nic-{index}"),
        }
    }

    fn body(&self, kind: Kind, index: usize, v: u32) -> Value {
        let name = Runner::name(kind, index);
        match kind {
            Kind::Slice => fixtures::galactic_slice(
                &self.ns,
                &name,
                json!([fixtures::pod_endpoint(&format!("fd20::{v:x}"), &name)]),
                None,
            ),
            Kind::Interface => {
                let mut ni = fixtures::network_interface(&self.ns, &name, "default", &name, "web", &self.location);
                ni["spec"]["mtu"] = json!(1300 + v);
                ni
            }
        }
    }

    async fn one(&self, op: Op) -> Result<(), replicator_e2e::Error> {
        let resource = match op.kind {
            Kind::Slice => &self.es,
            Kind::Interface => &self.ni,
        };

        match op.write {
            Write::Apply(v) => fixtures::apply(&self.cell, resource, &self.body(op.kind, op.index, v))
                .await
                .map(|_| ()),
            Write::Delete => fixtures::delete(&self.cell, resource, &self.ns, &Runner::name(op.kind, op.index)).await,
        }
    }

    /// Runs `ops` in `lanes` parallel lanes; the ops of one object always share a lane, so
    /// they apply in order. `done` counts finished ops.
    async fn run(&self, ops: Vec<Op>, lanes: usize, done: Arc<AtomicUsize>) -> ChurnStats {
        let mut by_lane: Vec<Vec<Op>> = vec![Vec::new(); lanes];
        for op in ops {
            let lane = (op.index * 2 + op.kind as usize) % lanes;
            by_lane[lane].push(op);
        }
        let results = futures::future::join_all(by_lane.into_iter().map(|lane| {
            let done = Arc::clone(&done);
            async move {
                let mut stats = ChurnStats::default();
                for op in lane {
                    match self.one(op).await {
                        Ok(()) => match op.write {
                            Write::Apply(_) => stats.applied += 1,
                            Write::Delete => stats.deleted += 1,
                        },
                        Err(e) => {
                            stats.failed += 1;
                            stats.first_error.get_or_insert_with(|| format!("{op:?}: {e}"));
                        }
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
                stats
            }
        }))
        .await;
        let mut total = ChurnStats::default();
        for stats in results {
            total.add(stats);
        }
        total
    }
}

/// Runs random churn, `per_tick` ops every second, until `stop` is set.
async fn paced_churn(churn: &mut Churn, runner: &Runner, per_tick: usize, stop: &AtomicBool) -> ChurnStats {
    let mut total = ChurnStats::default();
    // Pacing a load generator, not synchronisation: it writes at a steady rate until told.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let ops = churn.random(per_tick);
        total.add(runner.run(ops, 8, Arc::default()).await);
    }
    total
}

fn churn_rules() -> Vec<Rule> {
    convergence::default_rules(&["endpointslices", "networkinterfaces"]).unwrap()
}

/// [`convergence::wait_converged`], failing the drill with the last report on timeout.
async fn wait_converged(
    cell: &Client,
    hub: &Client,
    ns: &str,
    loc: &str,
    rules: &[Rule],
    deadline: Duration,
) -> convergence::Report {
    convergence::wait_converged(cell, hub, ns, loc, rules, deadline)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// After convergence, a whole sweep pass and one more change later, the hub still matches
/// the cell exactly: no deleted source came back, nothing was collected that should stay.
async fn assert_stays_converged(r: &ReplicatorProcess, cell: &Client, hub: &Client, ns: &str, loc: &str) {
    let runs = metric(r, "replicator_sweep_runs_total", &[("location", loc)]).await;
    wait::until(
        Duration::from_secs(60),
        "a whole sweep pass after convergence",
        || async {
            let n = r.counter("replicator_sweep_runs_total", &[("location", loc)]).await?;
            Ok::<_, replicator_e2e::Error>((n >= runs + 2.0).then_some(()))
        },
    )
    .await
    .unwrap();
    // A change after the sweeps is the barrier: once its copy is there, everything queued
    // before it has been processed.
    let es = fixtures::resource("endpointslices").unwrap();
    fixtures::apply(
        cell,
        &es,
        &fixtures::galactic_slice(
            ns,
            "barrier",
            json!([fixtures::pod_endpoint("fd20::b", "barrier")]),
            None,
        ),
    )
    .await
    .unwrap();
    let report = wait_converged(cell, hub, ns, loc, &churn_rules(), CONVERGE).await;
    assert!(report.converged(), "{}", report.summary());
}

// ---------------------------------------------------------------------------------------------
// Drill 1: SIGKILL in the middle of a burst of 2,000 changes.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn sigkill_in_the_middle_of_a_burst_of_2000_changes() -> TestResult {
    let _wall = WallTime::start("sigkill_in_the_middle_of_a_burst_of_2000_changes");
    let env = Environment::ensure_up().await?;
    _wall.phase("environment up");
    let (ns, loc) = (unique("kill"), unique("loc"));
    let _tidy = Tidy::new(&env, CELL_A, &[&ns], &loc);
    drill_namespace(&env, CELL_A, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let spec = || {
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .args(["--sweep-interval", "3s"])
    };
    let mut r = start(&env, spec()).await;
    _wall.phase("replicator ready");

    let mut churn = Churn::new(&ns, &loc, 300);
    let runner = churn.runner(&cell);
    let seeded = runner.run(churn.seed(150), 16, Arc::default()).await;
    assert_eq!(seeded.failed, 0, "{seeded:?}");
    let base = wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), Duration::from_secs(120)).await;
    _wall.phase("seed converged");
    eprintln!("seeded: {}", base.summary());

    // The burst runs on; the replicator is killed when half of it has been written.
    let ops = churn.random(2000);
    let done = Arc::new(AtomicUsize::new(0));
    let t = Instant::now();
    let burst = {
        let (runner, done) = (runner.clone(), Arc::clone(&done));
        tokio::spawn(async move { runner.run(ops, 16, done).await })
    };
    wait::until(Duration::from_secs(120), "half of the burst to be written", || {
        let n = done.load(Ordering::Relaxed);
        async move { Ok::<_, String>((n >= 1000).then_some(())) }
    })
    .await?;
    let status = r.kill().await?;
    let killed_at = done.load(Ordering::Relaxed);
    assert!(!status.success(), "SIGKILL, not a clean exit: {status:?}");
    let stats = burst.await?;
    _wall.phase("burst written, replicator killed half-way");
    eprintln!(
        "burst of 2000 written in {:.1}s ({stats:?}); SIGKILL after {killed_at}",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(
        stats.failed, 0,
        "every change of the burst was accepted by the cell: {stats:?}"
    );
    assert!(
        killed_at < 2000,
        "the kill happened while the burst was still being written"
    );

    let t = Instant::now();
    let r = start(&env, spec()).await;
    let report = wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), AFTER_FAULT).await;
    _wall.phase("restarted and converged");
    announce("sigkill-mid-burst", t.elapsed());
    eprintln!("final: {}", report.summary());
    let expected = churn.live.len();
    assert_eq!(
        report.expected_total(),
        expected,
        "the cell holds what the churn believes is live"
    );
    assert_stays_converged(&r, &cell, &hub, &ns, &loc).await;
    _wall.phase("stayed converged; tidying up");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Drill 2: the hub apiserver down for 60 seconds under churn.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn hub_down_for_60_seconds_under_churn() -> TestResult {
    let _wall = WallTime::start("hub_down_for_60_seconds_under_churn");
    let env = Environment::ensure_up().await?;
    _wall.phase("environment up");
    let (ns, loc) = (unique("hubdown"), unique("loc"));
    let _tidy = Tidy::new(&env, CELL_A, &[&ns], &loc);
    drill_namespace(&env, CELL_A, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = start(
        &env,
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .args(["--sweep-interval", "5s"]),
    )
    .await;
    let mut churn = Churn::new(&ns, &loc, 200);
    let runner = churn.runner(&cell);
    let seeded = runner.run(churn.seed(60), 16, Arc::default()).await;
    assert_eq!(seeded.failed, 0, "{seeded:?}");
    wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), Duration::from_secs(60)).await;
    let before: BTreeMap<(Kind, usize), u32> = churn.live.clone();
    let deletes_before = withdrawals(&r, &loc).await;
    _wall.phase("seed converged");

    env.stop_apiserver(HUB).await?;
    let down_at = Instant::now();
    _wall.phase("hub stopped");
    let stop = AtomicBool::new(false);
    let (stats, ()) = tokio::join!(paced_churn(&mut churn, &runner, 10, &stop), async {
        wait::until(
            Duration::from_secs(30),
            "the replicator to report the hub down",
            || async {
                Ok::<_, replicator_e2e::Error>(
                    r.metric("replicator_hub_up", &[("location", loc.as_str())])
                        .await?
                        .filter(|v| *v == 0.0),
                )
            },
        )
        .await
        .unwrap();
        // The fault lasts the drill's 60 s: this holds the outage, it synchronises nothing.
        tokio::time::sleep_until((down_at + Duration::from_secs(60)).into()).await;
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!("churn during the outage: {stats:?}");
    assert_eq!(
        stats.failed, 0,
        "the cell took every change while the hub was away: {stats:?}"
    );

    // The hub comes back; convergence is timed from the moment its apiserver answers again, while
    // the harness still restarts Karmada's watchers.
    _wall.phase("outage over");
    let t = Instant::now();
    let hub_url = format!("{}/readyz", env.server_url(HUB));
    let ((), back_after) = tokio::join!(
        async {
            env.start_apiserver(HUB).await.unwrap();
            eprintln!(
                "hub restart, Karmada's watchers included, took {:.1}s",
                t.elapsed().as_secs_f64()
            );
        },
        async {
            wait::until(Duration::from_secs(120), "the hub apiserver to answer", || {
                let hub = hub.clone();
                async move { Ok::<_, kube::Error>(hub.apiserver_version().await.ok().map(|_| ())) }
            })
            .await
            .unwrap();
            let back = t.elapsed();
            let report = wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), AFTER_FAULT).await;
            report_outage(back, t.elapsed() - back, &report, &hub_url);
            back
        }
    );
    assert!(back_after < Duration::from_secs(120));
    _wall.phase("hub back and converged");
    // The prober reports the hub up again within its one-second period.
    wait::until(CONVERGE, "replicator_hub_up back to 1", || async {
        Ok::<_, replicator_e2e::Error>(
            r.metric("replicator_hub_up", &[("location", loc.as_str())])
                .await?
                .filter(|v| *v == 1.0),
        )
    })
    .await?;

    // Nothing was deleted because of the outage: exactly the copies whose sources the churn
    // deleted were withdrawn.
    let gone = before.keys().filter(|k| !churn.live.contains_key(k)).count();
    let withdrawn = withdrawals(&r, &loc).await - deletes_before;
    assert_eq!(
        withdrawn, gone as f64,
        "withdrawals: exactly the {gone} deleted sources that had copies"
    );
    assert_stays_converged(&r, &cell, &hub, &ns, &loc).await;
    _wall.phase("stayed converged; tidying up");
    Ok(())
}

fn report_outage(back: Duration, converge: Duration, final_state: &convergence::Report, url: &str) {
    eprintln!(
        "hub {url} answered {:.1}s after the restart began; {}",
        back.as_secs_f64(),
        final_state.summary()
    );
    announce("hub-down-60s", converge);
}

/// Copies `loc` withdrew so far, by watched delete or sweep, of the churn's kinds.
async fn withdrawals(r: &ReplicatorProcess, loc: &str) -> f64 {
    let mut n = 0.0;
    for kind in ["EndpointSlice", "NetworkInterface"] {
        n += metric(
            r,
            "replicator_writes_total",
            &[("kind", kind), ("location", loc), ("op", "delete")],
        )
        .await;
        n += metric(
            r,
            "replicator_sweep_deleted_total",
            &[("kind", kind), ("location", loc)],
        )
        .await;
    }
    n
}

// ---------------------------------------------------------------------------------------------
// Drill 3: the cell apiserver restarted under churn.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn cell_apiserver_restarted_under_churn() -> TestResult {
    let _wall = WallTime::start("cell_apiserver_restarted_under_churn");
    let env = Environment::ensure_up().await?;
    _wall.phase("environment up");
    let (ns, loc) = (unique("cellrestart"), unique("loc"));
    let _tidy = Tidy::new(&env, CELL_A, &[&ns], &loc);
    drill_namespace(&env, CELL_A, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = start(
        &env,
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .args(["--sweep-interval", "5s"]),
    )
    .await;
    let mut churn = Churn::new(&ns, &loc, 200);
    let runner = churn.runner(&cell);
    let seeded = runner.run(churn.seed(60), 16, Arc::default()).await;
    assert_eq!(seeded.failed, 0, "{seeded:?}");
    wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), Duration::from_secs(60)).await;
    _wall.phase("seed converged");

    let stop = AtomicBool::new(false);
    let mut t = Instant::now();
    let (stats, ()) = tokio::join!(paced_churn(&mut churn, &runner, 10, &stop), async {
        // The churn runs before, during (refused) and after the restart.
        env.stop_apiserver(CELL_A).await.unwrap();
        env.start_apiserver(CELL_A).await.unwrap();
        t = Instant::now();
        _wall.phase("cell apiserver restarted");
        // The churn keeps writing to the restarted apiserver until the watches are back.
        wait::until(
            Duration::from_secs(60),
            "the replicator's cell watches to resume",
            || async {
                let up = r
                    .metric(
                        "replicator_source_up",
                        &[("kind", "EndpointSlice"), ("location", loc.as_str())],
                    )
                    .await?;
                Ok::<_, replicator_e2e::Error>(up.filter(|v| *v == 1.0).map(|_| ()))
            },
        )
        .await
        .unwrap();
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!("churn around the restart: {stats:?} (refused while the cell was down)");
    let report = wait_converged(&cell, &hub, &ns, &loc, &churn_rules(), AFTER_FAULT).await;
    announce("cell-apiserver-restart", t.elapsed());
    _wall.phase("converged");
    eprintln!("final: {}", report.summary());
    assert_stays_converged(&r, &cell, &hub, &ns, &loc).await;
    _wall.phase("stayed converged; tidying up");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Drill 4: etcd compacted during a watch gap: 410 Gone, relist, the gap's deletions collected.
// ---------------------------------------------------------------------------------------------

/// kube-apiserver's watch cache keeps at least this much history (DefaultEventFreshDuration in
/// k8s.io/apiserver: the bookmark frequency plus 15 s); an event younger than that is never
/// evicted, however much churn follows.
const WATCH_CACHE_WINDOW: Duration = Duration::from_secs(75);

/// `text` without ANSI colour sequences (the replicator colours its text log).
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether a watch of `resource` from `rv` is answered "410 Gone / too old resource version".
async fn watch_expired(api: &Api<DynamicObject>, rv: &str) -> Result<Option<String>, kube::Error> {
    let stream = api.watch(&WatchParams::default().timeout(5), rv).await?;
    let mut stream = stream.boxed();
    let first = tokio::time::timeout(Duration::from_secs(3), stream.try_next()).await;
    Ok(match first {
        Ok(Ok(Some(WatchEvent::Error(status)))) if status.code == 410 => Some(status.message),
        _ => None,
    })
}

/// A partition hides deletions (and updates, creates) from the replicator's cell watches, etcd
/// is compacted past them and the apiserver's watch cache lets them go: the resumed watch gets
/// 410 Gone, relists, and the relist collects the deleted sources' copies.
async fn watch_gap_drill(env: &Environment) -> TestResult {
    let (ns, loc) = (unique("gap"), unique("loc"));
    let _tidy = Tidy::new(env, CELL_A, &[&ns], &loc);
    drill_namespace(env, CELL_A, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let subnets = fixtures::resource("subnets")?;
    let rules = convergence::default_rules(&["subnets"])?;
    let subnet = |i: usize, network: &str| fixtures::subnet(&ns, &format!("sub-{i}"), network, "ctx", &loc);
    for i in 0..20 {
        fixtures::apply(&cell, &subnets, &subnet(i, "net-1")).await?;
    }

    // The replicator reaches its cell through a proxy the drill can cut.
    let upstream = env.server_url(CELL_A).trim_start_matches("https://").parse()?;
    let proxy = FaultProxy::start(upstream).await?;
    let ids = env.least_privilege().await?;
    let via = env
        .dir()
        .join("scratch")
        .join(format!("{loc}-cell-via-proxy.kubeconfig"));
    ids.write_cell_kubeconfig_via(env, CELL_A, &proxy.https_url(), &via)
        .await?;
    // The periodic sweep is out of the way (10 min): what collects the gap's deletions must be
    // the relist.
    let r = start(
        env,
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .cell_kubeconfig(&via)
            .args(["--sweep-interval", "10m"]),
    )
    .await;
    wait_converged(&cell, &hub, &ns, &loc, &rules, CONVERGE).await;
    let log_before = std::fs::read_to_string(r.log_path())?.len();

    // A partition that drops traffic: the replicator's watches hang, seeing nothing, until the
    // link comes back and the held connections are closed.
    proxy.blackhole();
    let all = Api::<DynamicObject>::all_with(cell.clone(), &subnets);
    let cut_rv = all
        .list(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .unwrap();
    // The gap: deletions, updates and creates the replicator does not see.
    let gap_start = Instant::now();
    for i in 0..5 {
        fixtures::delete(&cell, &subnets, &ns, &format!("sub-{i}")).await?;
    }
    for i in 5..10 {
        fixtures::apply(&cell, &subnets, &subnet(i, "net-2")).await?;
    }
    for i in 20..25 {
        fixtures::apply(&cell, &subnets, &subnet(i, "net-1")).await?;
    }
    let revision = env.etcd_revision().await?;
    env.etcd_compact(revision).await?;
    let refused = env.etcd_read_at(revision - 1).await?;
    assert!(
        refused.as_deref().is_some_and(|m| m.contains("compacted")),
        "etcd no longer serves the gap: {refused:?}"
    );
    // etcd has dropped the gap's history; the apiserver's watch cache still holds it for its
    // window. Churn until the cell itself answers a watch from the cut "too old".
    let churned = AtomicUsize::new(0);
    let expired = wait::until_observed(
        WATCH_CACHE_WINDOW + Duration::from_secs(90),
        "the cell to answer a watch from before the gap with 410",
        || async {
            if let Some(message) = watch_expired(&all, &cut_rv).await? {
                return Ok::<_, replicator_e2e::Error>(wait::Check::Ready(message));
            }
            if gap_start.elapsed() >= WATCH_CACHE_WINDOW {
                for _ in 0..50 {
                    let n = churned.fetch_add(1, Ordering::Relaxed);
                    fixtures::apply(&cell, &subnets, &subnet(25, &format!("churn-{}", n % 7))).await?;
                }
            }
            Ok(wait::Check::NotYet(format!(
                "watch from {cut_rv} still served; {} churn writes",
                churned.load(Ordering::Relaxed)
            )))
        },
    )
    .await?;
    eprintln!(
        "cell answers a watch from {cut_rv} with {expired:?} after {:.1}s and {} churn writes",
        gap_start.elapsed().as_secs_f64(),
        churned.load(Ordering::Relaxed)
    );

    proxy.restore();
    let t = Instant::now();
    let report = wait_converged(&cell, &hub, &ns, &loc, &rules, AFTER_FAULT).await;
    announce("watch-410-relist", t.elapsed());
    eprintln!("final: {}", report.summary());
    for i in 0..5 {
        assert!(
            fixtures::get(&hub, &subnets, &ns, &copy_name(&ns, &format!("sub-{i}"), &loc))
                .await?
                .is_none()
        );
    }

    // The proof that a 410 and a relist really happened, from the replicator's own log, and
    // that the relist (not a sweep) withdrew the copies.
    let log = plain(&std::fs::read_to_string(r.log_path())?[log_before..]);
    let gone = log
        .lines()
        .position(|l| {
            l.contains("kind=Subnet") && l.contains("cell watch failed") && l.contains("too old resource version")
        })
        .unwrap_or_else(|| panic!("no 410 on the Subnet watch in the log:\n{log}"));
    eprintln!("{}", log.lines().nth(gone).unwrap_or_default());
    assert!(
        log.lines()
            .skip(gone)
            .any(|l| l.contains("kind=Subnet") && l.contains("cell list complete")),
        "the Subnet watch relisted after the 410:\n{log}"
    );
    let labels = [("kind", "Subnet"), ("location", loc.as_str())];
    assert_eq!(
        metric(&r, "replicator_writes_total", &[labels[0], labels[1], ("op", "delete")]).await,
        5.0,
        "the relist withdrew exactly the five copies whose sources went in the gap"
    );
    assert_eq!(
        metric(&r, "replicator_sweep_deleted_total", &labels).await,
        0.0,
        "the sweep collected nothing: the relist did"
    );
    drop(proxy);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Drill 5: writes the hub refuses.
// ---------------------------------------------------------------------------------------------

/// The label a ValidatingAdmissionPolicy on the hub rejects on EndpointSlices.
const REJECT_LABEL: &str = "drill.replicator.datumapis.com/reject";
/// The hub namespace label a ValidatingAdmissionPolicy closes to Network writes (403).
const FROZEN_LABEL: &str = "drill.replicator.datumapis.com/frozen";
/// The finalizer holding the terminating namespace open.
const HOLD_FINALIZER: &str = "drill.replicator.datumapis.com/hold";
/// The window over which the retry rate is measured.
const RETRY_WINDOW: Duration = Duration::from_secs(40);

/// The most attempts one key can make in any window of `window`, following
/// [`ErrorClass::retry_after`]: the densest window starts at a failure and holds it and every
/// retry whose cumulative delay fits.
fn max_attempts(class: ErrorClass, window: Duration) -> u32 {
    let mut attempts = 1;
    let mut elapsed = Duration::ZERO;
    for attempt in 1.. {
        let Some(delay) = class.retry_after(attempt) else {
            break;
        };
        elapsed += delay;
        if elapsed > window {
            break;
        }
        attempts += 1;
    }
    attempts
}

async fn apply_hub_object(hub: &Client, object: Value) {
    let (group, version) = object["apiVersion"].as_str().unwrap().split_once('/').unwrap();
    let kind = object["kind"].as_str().unwrap();
    let lower = kind.to_lowercase();
    let plural = match lower.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{lower}s"),
    };
    let resource = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural,
    };
    let name = object["metadata"]["name"].as_str().unwrap();
    Api::<DynamicObject>::all_with(hub.clone(), &resource)
        .patch(
            name,
            &PatchParams::apply("replicator-drills").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap();
}

/// Deletes the cluster-scoped admission policies of a drill when dropped, pass or fail, and
/// releases the hold on its terminating namespace.
struct PolicyCleanup {
    kubectl: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
    names: Vec<String>,
    held_namespace: String,
}

impl Drop for PolicyCleanup {
    fn drop(&mut self) {
        let _ = std::process::Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args([
                "-n",
                &self.held_namespace,
                "patch",
                "configmap",
                "holder",
                "--type=merge",
            ])
            .args(["-p", r#"{"metadata":{"finalizers":null}}"#])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        for name in &self.names {
            for kind in ["validatingadmissionpolicybinding", "validatingadmissionpolicy"] {
                let _ = std::process::Command::new(&self.kubectl)
                    .arg("--kubeconfig")
                    .arg(&self.kubeconfig)
                    .args(["delete", "--ignore-not-found", "--wait=false", kind, name])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
}

/// Waits until a server-side dry run of `object` in `ns` is refused with `code`.
async fn wait_refused(hub: &Client, resource: &ApiResource, ns: &str, object: &Value, code: u16) {
    let api = Api::<DynamicObject>::namespaced_with(hub.clone(), ns, resource);
    let obj: DynamicObject = serde_json::from_value(object.clone()).unwrap();
    let what = format!("the hub to refuse {} in {ns} with {code}", resource.kind);
    wait::until_observed(CONVERGE, &what, || {
        let (api, obj) = (api.clone(), obj.clone());
        async move {
            let params = PostParams {
                dry_run: true,
                ..PostParams::default()
            };
            Ok::<_, String>(match api.create(&params, &obj).await {
                Err(kube::Error::Api(s)) if s.code == code => wait::Check::Ready(()),
                other => wait::Check::NotYet(format!("{:?}", other.map(|o| o.name_any()))),
            })
        }
    })
    .await
    .unwrap();
}

/// Waits for a Warning Event with `reason` on each of `names` in the cell namespace `ns`.
async fn wait_events(cell: &Client, ns: &str, reason: &str, names: &[&str]) -> Vec<String> {
    let events = Api::<Event>::namespaced(cell.clone(), ns);
    let mut notes = Vec::new();
    for name in names {
        let what = format!("a {reason} Event on {ns}/{name}");
        let event = wait::until(CONVERGE, &what, || async {
            let list = events.list(&ListParams::default()).await?;
            Ok::<_, kube::Error>(list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(*name)
            }))
        })
        .await
        .unwrap();
        notes.push(event.note.unwrap_or_default());
    }
    notes
}

/// One kind of refusal: its metric series and the keys refused.
struct Refusal {
    name: &'static str,
    kind: &'static str,
    class: ErrorClass,
    keys: u32,
}

/// Writes the hub refuses: (a) an object an admission policy rejects (422), (b) a namespace an
/// admission policy closes (403), (c) a namespace held in Terminating (403 on create). Each gets
/// an Event in the cell and a metric, is retried at a rate the backoff bounds, withdraws nothing,
/// and blocks no other object; each converges once lifted.
async fn refused_writes_drill(env: &Environment) -> TestResult {
    let id = unique("refuse");
    let loc = unique("loc");
    let (ns_ok, ns_a, ns_b) = (format!("{id}-ok"), format!("{id}-invalid"), format!("{id}-forbidden"));
    let ns_c = format!("{id}-terminating");
    let _tidy = Tidy::new(env, CELL_B, &[&ns_ok, &ns_a, &ns_b, &ns_c], &loc);
    for ns in [&ns_ok, &ns_a, &ns_b, &ns_c] {
        drill_namespace(env, CELL_B, ns).await;
    }
    let (cell, hub) = (env.client(CELL_B).await?, env.client(HUB).await?);
    let (es, net, ctx) = (
        fixtures::resource("endpointslices")?,
        fixtures::resource("networks")?,
        fixtures::resource("networkcontexts")?,
    );
    let r = start(env, ReplicatorSpec::new(CELL_B).location(&loc)).await;
    let slice = |ns: &str, name: &str, reject: bool| {
        let mut s = fixtures::galactic_slice(ns, name, json!([fixtures::pod_endpoint("fd20::1", name)]), None);
        if reject {
            s["metadata"]["labels"][REJECT_LABEL] = json!("true");
        }
        s
    };

    // Before the refusals: copies that must survive them.
    fixtures::apply(&cell, &es, &slice(&ns_a, "upd", false)).await?;
    fixtures::apply(&cell, &es, &slice(&ns_a, "good", false)).await?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns_b, "old")).await?;
    fixtures::apply(&cell, &ctx, &fixtures::network_context(&ns_c, "ctx-old", "net", &loc)).await?;
    for (resource, ns, name) in [
        (&es, &ns_a, "upd"),
        (&es, &ns_a, "good"),
        (&net, &ns_b, "old"),
        (&ctx, &ns_c, "ctx-old"),
    ] {
        fixtures::wait_for(&hub, resource, ns, &copy_name(ns, name, &loc), CONVERGE, "copy", |_| {
            true
        })
        .await?;
    }

    // (a) An admission policy rejecting labelled slices (422); (b) one closing a namespace to
    // Network writes (403); (c) a namespace held in Terminating by a finalizer.
    let reject = format!("{id}-reject");
    let frozen = format!("{id}-frozen");
    let _cleanup = PolicyCleanup {
        kubectl: env.binaries().kubectl.clone(),
        kubeconfig: env.kubeconfig_path(HUB),
        names: vec![reject.clone(), frozen.clone()],
        held_namespace: ns_c.clone(),
    };
    let vap = "admissionregistration.k8s.io/v1";
    apply_hub_object(&hub, json!({"apiVersion": vap, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": reject},
        "spec": {"failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": ["discovery.k8s.io"], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["endpointslices"]}]},
            "validations": [{"expression": format!("!has(object.metadata.labels) || !('{REJECT_LABEL}' in object.metadata.labels)"),
                "message": "the hub refuses slices labelled for rejection"}]}})).await;
    apply_hub_object(
        &hub,
        json!({"apiVersion": vap, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": reject},
        "spec": {"policyName": reject, "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns_a}}}}}),
    )
    .await;
    apply_hub_object(
        &hub,
        json!({"apiVersion": vap, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": frozen},
        "spec": {"failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": ["networking.datumapis.com"], "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"], "resources": ["networks"]}]},
            "validations": [{"expression": "false", "reason": "Forbidden",
                "message": "this namespace is closed to Network writes"}]}}),
    )
    .await;
    apply_hub_object(
        &hub,
        json!({"apiVersion": vap, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": frozen},
        "spec": {"policyName": frozen, "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {FROZEN_LABEL: "true"}}}}}),
    )
    .await;
    let hub_ns = Api::<Namespace>::all(hub.clone());
    hub_ns
        .patch(
            &ns_b,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {FROZEN_LABEL: "true"}}})),
        )
        .await?;
    wait_refused(&hub, &es, &ns_a, &slice(&ns_a, "probe", true), 422).await;
    wait_refused(&hub, &net, &ns_b, &fixtures::network(&ns_b, "probe"), 403).await;
    let holder = Api::<ConfigMap>::namespaced(hub.clone(), &ns_c);
    holder
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "holder", "finalizers": [HOLD_FINALIZER]}}))?,
        )
        .await?;
    hub_ns.delete(&ns_c, &DeleteParams::default()).await?;
    // The namespace controller empties it, the hold keeps it: our copy goes, the namespace stays.
    fixtures::wait_gone(
        &hub,
        &ctx,
        &ns_c,
        &copy_name(&ns_c, "ctx-old", &loc),
        Duration::from_secs(60),
    )
    .await?;

    // The writes that are refused.
    let refused_at = Instant::now();
    fixtures::apply(&cell, &es, &slice(&ns_a, "bad", true)).await?;
    fixtures::apply(&cell, &es, &slice(&ns_a, "upd", true)).await?;
    let mut changed = fixtures::network(&ns_b, "old");
    changed["spec"]["mtu"] = json!(9000);
    fixtures::apply(&cell, &net, &changed).await?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns_b, "new")).await?;
    fixtures::apply(&cell, &ctx, &fixtures::network_context(&ns_c, "ctx-new", "net", &loc)).await?;

    let invalid = wait_events(&cell, &ns_a, "HubRejectedCopy", &["bad", "upd"]).await;
    let forbidden = wait_events(&cell, &ns_b, "HubWriteForbidden", &["new", "old"]).await;
    let terminating = wait_events(&cell, &ns_c, "HubWriteForbidden", &["ctx-new", "ctx-old"]).await;
    eprintln!(
        "events after {:.1}s: {invalid:?} {forbidden:?} {terminating:?}",
        refused_at.elapsed().as_secs_f64()
    );
    assert!(
        invalid.iter().all(|n| n.contains("refuses slices labelled")),
        "{invalid:?}"
    );
    assert!(
        forbidden.iter().all(|n| n.contains("closed to Network writes")),
        "{forbidden:?}"
    );
    assert!(
        terminating.iter().all(|n| n.contains("being terminated")),
        "{terminating:?}"
    );

    let refusals = [
        Refusal {
            name: "rejected-object",
            kind: "EndpointSlice",
            class: ErrorClass::Invalid,
            keys: 2,
        },
        Refusal {
            name: "forbidden-namespace",
            kind: "Network",
            class: ErrorClass::Forbidden,
            keys: 2,
        },
        Refusal {
            name: "terminating-namespace",
            kind: "NetworkContext",
            class: ErrorClass::Forbidden,
            keys: 2,
        },
    ];
    let count = |f: &Refusal| {
        let r = &r;
        let loc = loc.clone();
        let (kind, class) = (f.kind, f.class.metric_label());
        async move {
            metric(
                r,
                "replicator_errors_total",
                &[("kind", kind), ("location", &loc), ("class", class)],
            )
            .await
        }
    };
    let mut start_counts = Vec::new();
    for f in &refusals {
        let n = count(f).await;
        assert!(n >= f64::from(f.keys), "{}: every refused key counted: {n}", f.name);
        start_counts.push(n);
    }

    // The window: other objects keep flowing, in a namespace of their own and beside the
    // refused ones, while the refused keys are retried.
    let window_start = Instant::now();
    let mut flowed = 0;
    let mut slowest = Duration::ZERO;
    while window_start.elapsed() < RETRY_WINDOW {
        let t = Instant::now();
        let name = format!("flow-{flowed}");
        fixtures::apply(&cell, &net, &fixtures::network(&ns_ok, &name)).await?;
        fixtures::apply(&cell, &es, &slice(&ns_a, &name, false)).await?;
        fixtures::wait_for(
            &hub,
            &net,
            &ns_ok,
            &copy_name(&ns_ok, &name, &loc),
            CONVERGE,
            "flowing",
            |_| true,
        )
        .await?;
        fixtures::wait_for(
            &hub,
            &es,
            &ns_a,
            &copy_name(&ns_a, &name, &loc),
            CONVERGE,
            "flowing",
            |_| true,
        )
        .await?;
        slowest = slowest.max(t.elapsed());
        flowed += 1;
        // Paces the flow probes through the window (the window is what is measured).
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let window = window_start.elapsed();
    eprintln!(
        "{flowed} pairs of fresh objects flowed during the {:.0}s window (slowest {:.2}s)",
        window.as_secs_f64(),
        slowest.as_secs_f64()
    );
    for (f, before) in refusals.iter().zip(&start_counts) {
        let attempts = count(f).await - before;
        let per_minute = attempts * 60.0 / window.as_secs_f64();
        let bound = f64::from(f.keys * max_attempts(f.class, window));
        eprintln!(
            "drill refused-write {}: {attempts} attempts over {:.0}s = {per_minute:.1}/min for {} keys (bound {:.1}/min from retry_after)",
            f.name,
            window.as_secs_f64(),
            f.keys,
            bound * 60.0 / window.as_secs_f64()
        );
        assert!(
            attempts <= bound,
            "{}: {attempts} attempts exceed the backoff's {bound}",
            f.name
        );
        assert!(attempts >= 1.0, "{}: refused writes are still retried", f.name);
    }

    // Nothing published was withdrawn or overwritten by a refusal.
    let upd = fixtures::get(&hub, &es, &ns_a, &copy_name(&ns_a, "upd", &loc))
        .await?
        .unwrap();
    assert!(
        !upd.labels().contains_key(REJECT_LABEL),
        "the refused update did not land"
    );
    let old = fixtures::get(&hub, &net, &ns_b, &copy_name(&ns_b, "old", &loc))
        .await?
        .unwrap();
    assert_eq!(
        serde_json::to_value(&old)?["spec"]["mtu"],
        1460,
        "the old copy stays as it was"
    );
    for (ns, name) in [(&ns_a, "bad"), (&ns_b, "new")] {
        assert!(
            fixtures::get(
                &hub,
                if *ns == ns_a { &es } else { &net },
                ns,
                &copy_name(ns, name, &loc)
            )
            .await?
            .is_none()
        );
    }

    // Lifted, each timed on its own: (a) the source is fixed, (b) the namespace reopened (the
    // key's next slow retry picks it up: at most its current delay), (c) the namespace finishes
    // terminating and the platform makes it again (the hub namespace watch requeues at once).
    let rules_for = |names: &[&str]| convergence::default_rules(names).unwrap();
    let t = Instant::now();
    let lift_a = async {
        for name in ["bad", "upd"] {
            fixtures::apply(&cell, &es, &slice(&ns_a, name, false)).await.unwrap();
        }
        wait_converged(&cell, &hub, &ns_a, &loc, &rules_for(&["endpointslices"]), CONVERGE).await;
        t.elapsed()
    };
    let lift_b = async {
        hub_ns
            .patch(
                &ns_b,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {FROZEN_LABEL: null}}})),
            )
            .await
            .unwrap();
        let deadline = ErrorClass::Forbidden.retry_after(u32::MAX).unwrap() + CONVERGE;
        wait_converged(&cell, &hub, &ns_b, &loc, &rules_for(&["networks"]), deadline).await;
        t.elapsed()
    };
    let lift_c = async {
        holder
            .patch(
                "holder",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await
            .unwrap();
        wait::until(Duration::from_secs(120), "the terminating namespace to go", || async {
            Ok::<_, kube::Error>(hub_ns.get_opt(&ns_c).await?.is_none().then_some(()))
        })
        .await
        .unwrap();
        let gone = t.elapsed();
        drill_namespace(env, CELL_B, &ns_c).await;
        wait_converged(&cell, &hub, &ns_c, &loc, &rules_for(&["networkcontexts"]), CONVERGE).await;
        eprintln!(
            "the terminating namespace went {:.1}s after its hold was released",
            gone.as_secs_f64()
        );
        t.elapsed() - gone
    };
    let (a, b, c) = tokio::join!(lift_a, lift_b, lift_c);
    wait_converged(&cell, &hub, &ns_ok, &loc, &rules_for(&["networks"]), CONVERGE).await;
    for (f, took) in refusals.iter().zip([a, b, c]) {
        announce(&format!("refused-write {} lifted", f.name), took);
    }
    let slowest = a.max(b).max(c);
    announce("refused-writes-lifted", slowest);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Drills 4 and 5 side by side: they use different cells, and the watch gap spends most of its
// time waiting out the apiserver's watch-cache window.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_watch_gap_past_etcd_compaction_and_writes_the_hub_refuses() -> TestResult {
    let _wall = WallTime::start("a_watch_gap_past_etcd_compaction_and_writes_the_hub_refuses");
    let env = Environment::ensure_up().await?;
    _wall.phase("environment up");
    let (gap, refused) = tokio::join!(watch_gap_drill(&env), refused_writes_drill(&env));
    // Both are reported; the first failure fails the test.
    if let Err(e) = &gap {
        eprintln!("watch-gap drill failed: {e}");
    }
    if let Err(e) = &refused {
        eprintln!("refused-writes drill failed: {e}");
    }
    gap?;
    refused
}
