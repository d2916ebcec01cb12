//! The sweep's safety rules (issue 15, item 7), one scenario each, on the real local control
//! plane: `--sweep-max-deletes` caps a pass, a failed cell read keeps the copy, and a kind whose
//! cell watch is not trusted is not swept. What `mirror.rs` already proves is not repeated here
//! (the start-up sweep collects an orphan, another location's copies are never touched).
//!
//! Each scenario ends by showing that the copies it kept were real orphans: a replicator with a
//! working cell and the shipped RBAC, restarted as the same replica, collects them at once.
//! Orphans are made the way they arise in production: a source deleted while no replicator
//! watches it, or (where a replicator must be running) a hub copy whose source never existed.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kube::api::{DynamicObject, ListParams, PostParams};
use kube::{Api, ResourceExt};
use replicator::copy::copy_name;
use replicator::rules::LOCATION_LABEL;
use replicator_e2e::fixtures::{self, CONVERGE, IdentitySpec, Teardown, unique};
use replicator_e2e::{CELL_A, Environment, HUB, ReplicatorProcess, ReplicatorSpec, fault_proxy::FaultProxy, wait};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// What a scenario of namespace `ns` and location `location` removes at its end.
fn teardown(env: &Environment, ns: &str, location: &str) -> Teardown {
    let mut teardown = Teardown::new(env);
    teardown.namespace(&[HUB, CELL_A], ns);
    teardown.lease(&format!("replicator-{location}"));
    teardown
}

/// A routed namespace of its own in the hub and cell-a (no Karmada delivery involved).
async fn routed(env: &Environment, ns: &str) {
    fixtures::namespace_routed_to(env, &[HUB, CELL_A], ns, fixtures::UPSTREAM_CLUSTER, "default")
        .await
        .unwrap();
}

/// `replicator run` for cell-a as `location`, with only the Networks of `ns` as sources.
fn scoped(env: &Environment, ns: &str, location: &str) -> ReplicatorSpec {
    ReplicatorSpec::new(CELL_A)
        .location(location)
        .arg("--rules")
        .arg(fixtures::scenario_rules(env, ns, &["networks"]).unwrap())
}

/// Network `name` in `ns`, a source under [`scoped`].
fn network(ns: &str, name: &str) -> Value {
    fixtures::scenario_labelled(fixtures::network(ns, name))
}

async fn spawn(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(90)).await.unwrap();
    process
}

/// Waits until `r` reports `value` for `name` with `labels`, returning it.
async fn wait_metric(
    r: &ReplicatorProcess,
    name: &str,
    labels: &[(&str, &str)],
    deadline: Duration,
    accept: impl Fn(f64) -> bool,
) -> f64 {
    let what = format!("{name}{labels:?} on replicator {}", r.location());
    wait::until_observed(deadline, &what, || async {
        Ok::<_, replicator_e2e::Error>(match r.metric(name, labels).await? {
            Some(v) if accept(v) => wait::Check::Ready(v),
            other => wait::Check::NotYet(format!("{other:?}")),
        })
    })
    .await
    .unwrap()
}

/// The JSON log lines of `r` whose message is `message`.
fn log_lines(r: &ReplicatorProcess, message: &str) -> Vec<Value> {
    std::fs::read_to_string(r.log_path())
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["message"] == message)
        .collect()
}

/// The names of this location's Network copies in `ns` on the hub.
async fn copies(hub: &kube::Client, ns: &str, location: &str) -> Vec<String> {
    let net = fixtures::resource("networks").unwrap();
    let mut names: Vec<String> = Api::<DynamicObject>::namespaced_with(hub.clone(), ns, &net)
        .list_metadata(&ListParams::default().labels(&format!("{LOCATION_LABEL}={location}")))
        .await
        .unwrap()
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn the_delete_cap_spreads_orphans_over_passes_each_within_the_cap() -> TestResult {
    const ORPHANS: usize = 7;
    const CAP: usize = 2;
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("cap"), unique("loc"));
    let _teardown = teardown(&env, &ns, &loc);
    routed(&env, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let net = fixtures::resource("networks")?;

    let mut r = spawn(&env, scoped(&env, &ns, &loc)).await;
    let orphans: Vec<String> = (0..ORPHANS).map(|i| format!("orphan-{i}")).collect();
    for name in orphans.iter().map(String::as_str).chain(["live"]) {
        fixtures::apply(&cell, &net, &network(&ns, name)).await?;
    }
    for name in orphans.iter().map(String::as_str).chain(["live"]) {
        fixtures::wait_for(&hub, &net, &ns, &copy_name(&ns, name, &loc), CONVERGE, "copy", |_| true).await?;
    }

    // The sources go while nothing watches: every copy but `live`'s is an orphan at restart.
    let identity = r.identity().to_owned();
    r.kill().await?;
    for name in &orphans {
        fixtures::delete(&cell, &net, &ns, name).await?;
        fixtures::wait_gone(&cell, &net, &ns, name, CONVERGE).await?;
    }
    let r = spawn(
        &env,
        scoped(&env, &ns, &loc).identity(identity).args([
            "--sweep-interval",
            "2s",
            "--sweep-max-deletes",
            "2",
            "--log-format",
            "json",
        ]),
    )
    .await;

    // Hub state and the counters, sampled until the orphans are gone. Passes are at least 1.8 s
    // apart and the samples at most 1 s, so every pass's result is seen.
    let samples = std::sync::Mutex::new(Vec::<(f64, f64, usize)>::new());
    let location = [("location", loc.as_str())];
    let deleted_labels = [("kind", "Network"), ("location", loc.as_str())];
    wait::until_observed(Duration::from_secs(60), "every orphan collected", || {
        let (hub, ns, loc, r) = (&hub, &ns, &loc, &r);
        let samples = &samples;
        async move {
            let left = copies(hub, ns, loc).await.len() - 1;
            let runs = r.counter("replicator_sweep_runs_total", &location).await?;
            let deleted = r.counter("replicator_sweep_deleted_total", &deleted_labels).await?;
            samples.lock().unwrap().push((runs, deleted, left));
            Ok::<_, replicator_e2e::Error>(if left == 0 {
                wait::Check::Ready(())
            } else {
                wait::Check::NotYet(format!("{left} orphans left after {runs} passes"))
            })
        }
    })
    .await?;
    let samples = samples.into_inner().unwrap();
    eprintln!("(passes, deleted, orphans left) samples: {samples:?}");

    // What each pass deleted, as each pass reports it: never more than the cap, the cap whenever
    // orphans were left over, and all of them in the end.
    let per_pass: Vec<u64> = log_lines(&r, "sweep done")
        .iter()
        .map(|l| l["deleted"].as_u64().expect("a sweep-done line names what it deleted"))
        .filter(|d| *d > 0)
        .collect();
    assert_eq!(per_pass, [2, 2, 2, 1], "deletes per pass with a cap of {CAP}");
    assert_eq!(
        r.metric("replicator_sweep_deleted_total", &deleted_labels).await?,
        Some(ORPHANS as f64),
        "the sweep, not anything else, collected every orphan"
    );
    let runs = r.metric("replicator_sweep_runs_total", &location).await?;
    assert!(
        runs.is_some_and(|n| n >= ORPHANS.div_ceil(CAP) as f64),
        "{ORPHANS} orphans at {CAP} a pass take at least {} passes: {runs:?}",
        ORPHANS.div_ceil(CAP)
    );
    // Independently of the product's counters: no sample shows more copies gone than the cap
    // allows for the passes completed by then (plus the one that may be in flight).
    for (runs, _, left) in &samples {
        let gone = ORPHANS - left;
        assert!(
            gone as f64 <= CAP as f64 * (runs + 1.0),
            "{gone} orphans gone after {runs} passes: more than {CAP} a pass"
        );
    }
    assert_eq!(
        copies(&hub, &ns, &loc).await,
        [copy_name(&ns, "live", &loc)],
        "the live source's copy stays"
    );
    Ok(())
}

#[tokio::test]
async fn a_failed_cell_read_keeps_the_copy() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("readfail"), unique("loc"));
    let _teardown = teardown(&env, &ns, &loc);
    routed(&env, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let net = fixtures::resource("networks")?;
    let location = [("location", loc.as_str())];
    let kind = [("kind", "Network"), ("location", loc.as_str())];
    let never = ["--sweep-interval", "1h"];

    // Leader `a` reads the cell directly; standby `b` through a proxy the scenario breaks.
    let mut a = spawn(&env, scoped(&env, &ns, &loc).args(never)).await;
    fixtures::apply(&cell, &net, &network(&ns, "live")).await?;
    let live = fixtures::wait_for(&hub, &net, &ns, &copy_name(&ns, "live", &loc), CONVERGE, "copy", |_| {
        true
    })
    .await?;
    let upstream = env.server_url(CELL_A).trim_start_matches("https://").parse()?;
    let proxy = FaultProxy::start(upstream).await?;
    let via = env
        .dir()
        .join("scratch")
        .join(format!("{loc}-cell-via-proxy.kubeconfig"));
    env.least_privilege()
        .await?
        .write_cell_kubeconfig_via(&env, CELL_A, &proxy.https_url(), &via)
        .await?;
    let b_spec = scoped(&env, &ns, &loc).args(never).arg("--log-format").arg("json");
    let mut b = spawn(&env, b_spec.clone().cell_kubeconfig(&via)).await;
    assert_eq!(
        b.metric("replicator_leader", &location).await?,
        Some(0.0),
        "b is the standby"
    );

    // The cell stops answering b: its watches hang (no error: they stay trusted) and so will
    // any read. Then an orphan appears on the hub: a copy of this location whose source never
    // existed (made from the live copy, so it carries everything a copy of ours carries).
    proxy.blackhole();
    let mut orphan = serde_json::to_value(&live)?;
    let orphan_name = copy_name(&ns, "ghost", &loc);
    let metadata = orphan["metadata"].as_object_mut().unwrap();
    metadata.retain(|k, _| ["namespace", "labels", "annotations"].contains(&k.as_str()));
    metadata.insert("name".into(), json!(orphan_name));
    orphan["metadata"]["annotations"]["replicator.datumapis.com/source-name"] = json!("ghost");
    orphan.as_object_mut().unwrap().remove("status");
    // Made as the location's own identity, as a copy of it would be (the hub audit then
    // records its labels, so the sweep's delete reads as the location's own).
    let own = env.least_privilege().await?.hub_kubeconfig_for(&env, &loc).await?;
    Api::<DynamicObject>::namespaced_with(replicator_e2e::kubeconfig::client(&own).await?, &ns, &net)
        .create(&PostParams::default(), &serde_json::from_value(orphan)?)
        .await?;
    wait_metric(&b, "replicator_copies", &kind, CONVERGE, |n| n == 2.0).await;

    // a steps down; b leads and sweeps at once: the orphan's source is not in its cache, so it
    // reads the cell, and the read hangs. The probe reports the cell down meanwhile.
    a.terminate(Duration::from_secs(10)).await?;
    wait_metric(&b, "replicator_leader", &location, CONVERGE, |n| n == 1.0).await;
    wait_metric(&b, "replicator_cell_up", &location, CONVERGE, |n| n == 0.0).await;
    let runs = b.counter("replicator_sweep_runs_total", &location).await?;
    assert_eq!(runs, 0.0, "the pass waits on the cell read");

    // The link comes back and closes the held connection: the read fails, the pass ends.
    proxy.restore();
    wait_metric(&b, "replicator_sweep_runs_total", &location, CONVERGE, |n| n >= 1.0).await;
    assert!(
        fixtures::get(&hub, &net, &ns, &orphan_name).await?.is_some(),
        "the copy whose confirming read failed is kept"
    );
    let deleted = b.counter("replicator_sweep_deleted_total", &kind).await?;
    assert_eq!(deleted, 0.0, "nothing swept");
    let kept = log_lines(&b, "cell read failed; copy kept");
    assert!(
        kept.iter().any(|l| l["source"] == format!("{ns}/ghost")),
        "the kept copy is reported: {kept:?}"
    );
    let passes = log_lines(&b, "sweep done");
    assert_eq!(
        passes
            .first()
            .map(|l| (l["kept_on_error"].clone(), l["deleted"].clone())),
        Some((json!(1), json!(0)))
    );

    // It was an orphan: the same replica with a working cell collects it at once.
    let identity = b.identity().to_owned();
    b.terminate(Duration::from_secs(10)).await?;
    let c = spawn(&env, scoped(&env, &ns, &loc).identity(identity).args(never)).await;
    fixtures::wait_gone(&hub, &net, &ns, &orphan_name, CONVERGE).await?;
    assert_eq!(c.metric("replicator_sweep_deleted_total", &kind).await?, Some(1.0));
    assert_eq!(copies(&hub, &ns, &loc).await, [copy_name(&ns, "live", &loc)]);
    drop(proxy);
    Ok(())
}

#[tokio::test]
async fn a_kind_whose_cell_watch_never_listed_is_not_swept() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("unlisted"), unique("loc"));
    let mut teardown = teardown(&env, &ns, &loc);
    routed(&env, &ns).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let net = fixtures::resource("networks")?;
    let location = [("location", loc.as_str())];
    let kind = [("kind", "Network"), ("location", loc.as_str())];

    let mut a = spawn(&env, scoped(&env, &ns, &loc)).await;
    for name in ["live", "ghost"] {
        fixtures::apply(&cell, &net, &network(&ns, name)).await?;
        fixtures::wait_for(&hub, &net, &ns, &copy_name(&ns, name, &loc), CONVERGE, "copy", |_| true).await?;
    }
    let identity = a.identity().to_owned();
    a.kill().await?;
    fixtures::delete(&cell, &net, &ns, "ghost").await?;
    fixtures::wait_gone(&cell, &net, &ns, "ghost", CONVERGE).await?;

    // The shipped cell role, less list and watch on Networks: their watch can never list, while
    // the confirming read still works (and would answer "gone").
    let narrow = |o: &mut Value| {
        if o["kind"] != "ClusterRole" {
            return;
        }
        let rules = o["rules"].as_array_mut().unwrap();
        for rule in rules.iter_mut() {
            if let Some(resources) = rule["resources"].as_array_mut() {
                resources.retain(|r| r != "networks");
            }
        }
        rules.push(json!({"apiGroups": ["networking.datumapis.com"], "resources": ["networks"], "verbs": ["get"]}));
    };
    let narrowed = fixtures::composed_identity(
        &env,
        &IdentitySpec {
            name: &unique("nolist"),
            location: &loc,
            cell: CELL_A,
            cell_components: &[],
            hub_components: &[],
            edit_cell: Some(&narrow),
        },
    )
    .await?;
    teardown.identity(&narrowed);
    let mut b = ReplicatorProcess::spawn(
        &env,
        scoped(&env, &ns, &loc)
            .identity(&identity)
            .cell_kubeconfig(&narrowed.cell_kubeconfig)
            .hub_kubeconfig(&narrowed.hub_kubeconfig)
            .args(["--sweep-interval", "2s", "--log-format", "json"]),
    )
    .await?;

    // b leads and sweeps (the first pass after its one-minute wait for the lists), three passes,
    // and keeps the orphan every time, although its confirming read would say the source is gone.
    wait_metric(&b, "replicator_leader", &location, CONVERGE, |n| n == 1.0).await;
    wait_metric(
        &b,
        "replicator_sweep_runs_total",
        &location,
        Duration::from_secs(120),
        |n| n >= 3.0,
    )
    .await;
    let (status, body) = replicator_e2e::replicator_process::http_get(&format!("{}/readyz", b.health_url())).await?;
    assert_eq!(status, 503, "not ready while the Network list is pending: {body}");
    assert!(body.contains("Network"), "readyz names the kind: {body}");
    let narrowed_cell = replicator_e2e::kubeconfig::client(&narrowed.cell_kubeconfig).await?;
    assert!(
        fixtures::get(&narrowed_cell, &net, &ns, "ghost").await?.is_none(),
        "the confirming read works and finds the source gone"
    );
    let orphan_name = copy_name(&ns, "ghost", &loc);
    assert!(
        fixtures::get(&hub, &net, &ns, &orphan_name).await?.is_some(),
        "the orphan of a kind whose watch never listed is kept"
    );
    let deleted = b.counter("replicator_sweep_deleted_total", &kind).await?;
    assert_eq!(deleted, 0.0, "nothing swept");
    let skipped = log_lines(&b, "sweep done")
        .iter()
        .filter(|l| l["skipped"].as_str().is_some_and(|s| s.contains("\"Network\"")))
        .count();
    assert!(skipped >= 3, "every pass skipped Network: {skipped} of them did");
    b.terminate(Duration::from_secs(10)).await?;

    // It was an orphan: the same replica with the shipped RBAC collects it at once.
    let c = spawn(&env, scoped(&env, &ns, &loc).identity(identity)).await;
    fixtures::wait_gone(&hub, &net, &ns, &orphan_name, CONVERGE).await?;
    assert_eq!(c.metric("replicator_sweep_deleted_total", &kind).await?, Some(1.0));
    assert_eq!(copies(&hub, &ns, &loc).await, [copy_name(&ns, "live", &loc)]);
    Ok(())
}
