//! Leader election, several cells per process and the unreachable-cell policy (issue #6 §2, and
//! the "leader killed during a burst" drill of §3), on the real local control plane.
//!
//! Each scenario uses namespaces and location names of its own. Waits poll a condition with a
//! deadline; nothing sleeps to synchronise.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use futures::{StreamExt, TryStreamExt, stream};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DynamicObject, ListParams},
};
use replicator::rules::LOCATION_LABEL;
use replicator_e2e::{
    CELL_A, CELL_B, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, unique},
    wait,
};
use serde_json::json;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Deadline of a takeover after SIGKILL: the default --lease-duration (15 s) plus the burst.
const TAKEOVER: Duration = Duration::from_secs(90);

async fn start(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(60)).await.unwrap();
    process
}

async fn leader_gauge(p: &ReplicatorProcess, location: &str) -> Option<f64> {
    p.metric("replicator_leader", &[("location", location)])
        .await
        .ok()
        .flatten()
}

/// Waits until exactly one of `replicas` reports `replicator_leader 1` for `location` (and the
/// rest 0); returns its index.
async fn sole_leader(replicas: &[&ReplicatorProcess], location: &str, deadline: Duration) -> usize {
    wait::until(deadline, &format!("one leader for {location}"), || async {
        let mut gauges = Vec::new();
        for p in replicas {
            gauges.push(leader_gauge(p, location).await);
        }
        let leaders: Vec<usize> = (0..gauges.len()).filter(|i| gauges[*i] == Some(1.0)).collect();
        let rest_standing_by = gauges.iter().filter(|g| **g == Some(0.0)).count() == replicas.len() - 1;
        Ok::<_, String>((leaders.len() == 1 && rest_standing_by).then(|| leaders[0]))
    })
    .await
    .unwrap()
}

/// Copies of `location` in `ns` on the hub, by name, with their `spec.mtu`.
async fn copies(hub: &Client, ni: &ApiResource, ns: &str, location: &str) -> BTreeMap<String, i64> {
    Api::<DynamicObject>::namespaced_with(hub.clone(), ns, ni)
        .list(&ListParams::default().labels(&format!("{LOCATION_LABEL}={location}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| {
            let mtu = o.data["spec"]["mtu"].as_i64().unwrap_or_default();
            (o.name_any(), mtu)
        })
        .collect()
}

/// Waits until the hub holds exactly `want` (copy name → mtu) for `location` in `ns`.
async fn converge(
    hub: &Client,
    ni: &ApiResource,
    ns: &str,
    location: &str,
    want: &BTreeMap<String, i64>,
    deadline: Duration,
) {
    wait::until_observed(deadline, &format!("hub copies of {location} in {ns}"), || async {
        let have = copies(hub, ni, ns, location).await;
        Ok::<_, String>(if &have == want {
            wait::Check::Ready(())
        } else {
            let missing = want.keys().filter(|k| !have.contains_key(*k)).count();
            let extra = have.keys().filter(|k| !want.contains_key(*k)).count();
            let stale = want
                .iter()
                .filter(|(k, v)| have.get(*k).is_some_and(|h| h != *v))
                .count();
            wait::Check::NotYet(format!("{missing} missing, {extra} not wanted, {stale} stale"))
        })
    })
    .await
    .unwrap();
}

/// Applies `names` in the cell with `mtu`, 16 at a time.
async fn apply_all(cell: &Client, ni: &ApiResource, ns: &str, location: &str, names: &[String], mtu: i64) {
    stream::iter(names.iter().map(|name| {
        let mut o = fixtures::network_interface(ns, name, "default", name, "web", location);
        o["spec"]["mtu"] = json!(mtu);
        async move { fixtures::apply(cell, ni, &o).await.map(|_| ()) }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<()>>()
    .await
    .unwrap();
}

async fn delete_all(cell: &Client, ni: &ApiResource, ns: &str, names: &[String]) {
    stream::iter(names.iter().map(|name| fixtures::delete(cell, ni, ns, name)))
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
}

/// Two replicas of `loc` on cell-a, once one leads: (leader, standby).
async fn leader_and_standby(env: &Environment, loc: &str) -> (ReplicatorProcess, ReplicatorProcess) {
    let spec = || ReplicatorSpec::new(CELL_A).location(loc);
    let a = start(env, spec()).await;
    let b = start(env, spec()).await;
    match sole_leader(&[&a, &b], loc, Duration::from_secs(30)).await {
        0 => (a, b),
        _ => (b, a),
    }
}

fn count_lines(p: &ReplicatorProcess, needle: &str) -> usize {
    std::fs::read_to_string(p.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[tokio::test]
async fn the_standby_completes_a_burst_when_the_leader_is_killed() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("elect"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    let (mut leader, mut standby) = leader_and_standby(&env, &loc).await;
    let (leader, standby) = (&mut leader, &mut standby);
    let lists_before = count_lines(standby, "cell list complete");
    assert!(lists_before >= 1, "the standby listed the cell while standing by");

    // The burst: 600 creates (the leader is killed after the first 300), then 200 updates and
    // 100 deletes, all while the standby has not yet taken over.
    let names: Vec<String> = (0..600).map(|i| format!("ni-{i:04}")).collect();
    let t = Instant::now();
    apply_all(&cell, &ni, &ns, &loc, &names[..300], 1460).await;
    leader.kill().await?;
    let killed = Instant::now();
    apply_all(&cell, &ni, &ns, &loc, &names[300..], 1460).await;
    apply_all(&cell, &ni, &ns, &loc, &names[..200], 8800).await;
    delete_all(&cell, &ni, &ns, &names[500..]).await;
    eprintln!("burst of 900 changes written to the cell in {:?}", t.elapsed());

    let want: BTreeMap<String, i64> = names[..500]
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                replicator::copy::copy_name(&ns, n, &loc),
                if i < 200 { 8800 } else { 1460 },
            )
        })
        .collect();
    converge(&hub, &ni, &ns, &loc, &want, TAKEOVER).await;
    eprintln!(
        "drill leader-killed-mid-burst: converged in {:.1}s after the kill ({:.1}s after the burst began)",
        killed.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(leader_gauge(standby, &loc).await, Some(1.0), "the standby leads now");
    assert_eq!(
        count_lines(standby, "cell list complete"),
        lists_before,
        "the takeover relisted nothing: the standby's caches were warm"
    );
    let writes = |op: &'static str| {
        let standby: &ReplicatorProcess = standby;
        let loc = loc.clone();
        async move {
            standby
                .metric(
                    "replicator_writes_total",
                    &[("location", &loc), ("kind", "NetworkInterface"), ("op", op)],
                )
                .await
                .unwrap()
                .unwrap_or_default()
        }
    };
    let (created, skipped) = (writes("create").await, writes("skipped").await);
    eprintln!("the standby created {created} copies and found {skipped} already right");
    assert!(created > 0.0, "the standby wrote the copies the leader never did");
    assert!(
        skipped > 0.0,
        "copies the leader wrote were judged from the warm cache, not rewritten"
    );
    // Every later scenario's replicator mirrors all of cell-a: leave it 500 sources lighter.
    delete_all(&cell, &ni, &ns, &names[..500]).await;
    Ok(())
}

#[tokio::test]
async fn a_stopping_leader_releases_the_lease_and_the_standby_takes_over_at_once() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("handover"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    let (mut leader, mut standby) = leader_and_standby(&env, &loc).await;
    let (leader, standby) = (&mut leader, &mut standby);

    let t = Instant::now();
    leader.terminate(Duration::from_secs(20)).await?;
    // Well under the 15 s lease: the Lease was released, not left to expire.
    let standby_ref: &ReplicatorProcess = standby;
    sole_leader(&[standby_ref], &loc, Duration::from_secs(8)).await;
    eprintln!("handover after SIGTERM took {:?}", t.elapsed());

    apply_all(&cell, &ni, &ns, &loc, &["after".to_owned()], 1500).await;
    let want = BTreeMap::from([(replicator::copy::copy_name(&ns, "after", &loc), 1500)]);
    // The new leader first publishes everything earlier scenarios left in cell-a (a fresh
    // location has no copy yet), so allow for a long queue.
    converge(&hub, &ni, &ns, &loc, &want, Duration::from_secs(90)).await;
    Ok(())
}

/// Lease requests (every verb) `p` has sent so far.
async fn lease_requests(p: &ReplicatorProcess) -> f64 {
    replicator_e2e::metrics::parse(&p.scrape_metrics().await.unwrap())
        .iter()
        .filter(|s| s.name == "replicator_api_requests_total" && s.label("resource") == Some("leases"))
        .map(|s| s.value)
        .sum()
}

#[tokio::test]
async fn a_leader_renews_its_lease_once_per_renewal_interval() -> TestResult {
    // A regression seen in the benchmark: a select! that dropped the Lease manager's pending
    // renewal on every Lease event renewed in a loop, ~13 Lease requests per second.
    let env = Environment::ensure_up().await?;
    let loc = unique("renew");
    let mut teardown = fixtures::Teardown::new(&env);
    teardown.lease(&format!("replicator-{loc}"));
    let p = start(&env, ReplicatorSpec::new(CELL_A).location(&loc)).await;
    sole_leader(&[&p], &loc, Duration::from_secs(30)).await;
    let before = lease_requests(&p).await;
    // A measurement window, not a synchronisation: two renewals fall in it (15 s Lease, renewed
    // 5 s before expiry, so every 10 s), each a patch and at most a read.
    let window = Duration::from_secs(21);
    tokio::time::sleep(window).await;
    let sent = lease_requests(&p).await - before;
    eprintln!("Lease requests in {window:?} of leading: {sent}");
    assert!(sent >= 2.0, "the leader renewed at least twice in {window:?}: {sent}");
    assert!(
        sent <= 8.0,
        "at most 3 renewals × (patch + read) + the Lease watch: {sent}"
    );
    assert_eq!(leader_gauge(&p, &loc).await, Some(1.0), "still leading");
    Ok(())
}

#[tokio::test]
async fn one_process_serves_two_cells_with_a_lease_each() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc_a, loc_b) = (unique("multi"), unique("loca"), unique("locb"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc_a, &loc_b]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell_a, cell_b, hub) = (
        env.client(CELL_A).await?,
        env.client(CELL_B).await?,
        env.client(HUB).await?,
    );
    let ni = fixtures::resource("networkinterfaces")?;
    let p = start(&env, ReplicatorSpec::cells(&[(CELL_A, &loc_a), (CELL_B, &loc_b)])).await;
    sole_leader(&[&p], &loc_a, Duration::from_secs(30)).await;
    sole_leader(&[&p], &loc_b, Duration::from_secs(30)).await;

    let names_a: Vec<String> = (0..5).map(|i| format!("a-{i}")).collect();
    let names_b: Vec<String> = (0..3).map(|i| format!("b-{i}")).collect();
    apply_all(&cell_a, &ni, &ns, &loc_a, &names_a, 1460).await;
    apply_all(&cell_b, &ni, &ns, &loc_b, &names_b, 1400).await;
    let want = |names: &[String], loc: &str, mtu: i64| -> BTreeMap<String, i64> {
        names
            .iter()
            .map(|n| (replicator::copy::copy_name(&ns, n, loc), mtu))
            .collect()
    };
    converge(
        &hub,
        &ni,
        &ns,
        &loc_a,
        &want(&names_a, &loc_a, 1460),
        fixtures::CONVERGE,
    )
    .await;
    converge(
        &hub,
        &ni,
        &ns,
        &loc_b,
        &want(&names_b, &loc_b, 1400),
        fixtures::CONVERGE,
    )
    .await;

    // Each cell is its own source of truth: a delete in one leaves the other's copies alone.
    delete_all(&cell_b, &ni, &ns, &names_b[..1]).await;
    converge(
        &hub,
        &ni,
        &ns,
        &loc_b,
        &want(&names_b[1..], &loc_b, 1400),
        fixtures::CONVERGE,
    )
    .await;
    assert_eq!(copies(&hub, &ni, &ns, &loc_a).await, want(&names_a, &loc_a, 1460));
    Ok(())
}

#[tokio::test]
async fn an_unreachable_cell_is_withdrawn_after_its_grace_period_and_restored_when_it_returns() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, withdrawn, kept) = (unique("unreach"), unique("wd"), unique("keep"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&withdrawn, &kept]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_B).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    // Two locations on the same cell: one withdraws after 10 s, the other keeps (the default).
    let w = start(
        &env,
        ReplicatorSpec::new(CELL_B)
            .location(&withdrawn)
            .args(["--withdraw-unreachable-after", "10s"]),
    )
    .await;
    let k = start(&env, ReplicatorSpec::new(CELL_B).location(&kept)).await;
    let names: Vec<String> = (0..4).map(|i| format!("ni-{i}")).collect();
    apply_all(&cell, &ni, &ns, &withdrawn, &names[..2], 1460).await;
    apply_all(&cell, &ni, &ns, &kept, &names[2..], 1460).await;
    let want = |names: &[String], loc: &str| -> BTreeMap<String, i64> {
        names
            .iter()
            .map(|n| (replicator::copy::copy_name(&ns, n, loc), 1460))
            .collect()
    };
    // Both locations mirror the whole cell: each publishes all four.
    converge(
        &hub,
        &ni,
        &ns,
        &withdrawn,
        &want(&names, &withdrawn),
        fixtures::CONVERGE,
    )
    .await;
    converge(&hub, &ni, &ns, &kept, &want(&names, &kept), fixtures::CONVERGE).await;

    // The location mirrors every routed namespace of cell-b (other scenarios' too): all of its
    // NetworkInterface copies are withdrawn, not only this scenario's.
    let published = Api::<DynamicObject>::all_with(hub.clone(), &ni)
        .list(&ListParams::default().labels(&format!("{LOCATION_LABEL}={withdrawn}")))
        .await?
        .items
        .len();
    let down = Instant::now();
    env.stop_apiserver(CELL_B).await?;
    // Whatever the assertions say, the cell apiserver is started again before they are reported.
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(async {
        converge(&hub, &ni, &ns, &withdrawn, &BTreeMap::new(), Duration::from_secs(60)).await;
        let after = down.elapsed();
        assert!(
            after >= Duration::from_secs(10),
            "not before the grace period: {after:?}"
        );
        eprintln!("copies of the unreachable cell withdrawn {after:?} after it went down");
        // The rest of the location's copies (other namespaces) go the same way.
        wait::until(
            Duration::from_secs(60),
            "every copy of the location withdrawn",
            || async {
                let left = Api::<DynamicObject>::all_with(hub.clone(), &ni)
                    .list(&ListParams::default().labels(&format!("{LOCATION_LABEL}={withdrawn}")))
                    .await?
                    .items
                    .len();
                Ok::<_, kube::Error>((left == 0).then_some(()))
            },
        )
        .await
        .unwrap();
        assert_eq!(
            w.metric("replicator_cell_up", &[("location", &withdrawn)])
                .await
                .unwrap(),
            Some(0.0)
        );
        assert_eq!(
            w.metric(
                "replicator_withdrawn_total",
                &[("location", &withdrawn), ("kind", "NetworkInterface")]
            )
            .await
            .unwrap(),
            Some(published as f64)
        );
        assert_eq!(
            copies(&hub, &ni, &ns, &kept).await,
            want(&names, &kept),
            "the keep policy leaves its copies through the outage"
        );
    }))
    .await;
    env.start_apiserver(CELL_B).await?;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    let back = Instant::now();
    converge(
        &hub,
        &ni,
        &ns,
        &withdrawn,
        &want(&names, &withdrawn),
        Duration::from_secs(60),
    )
    .await;
    eprintln!("copies restored {:?} after the cell came back", back.elapsed());
    assert_eq!(copies(&hub, &ni, &ns, &kept).await, want(&names, &kept));
    drop(k);
    Ok(())
}
