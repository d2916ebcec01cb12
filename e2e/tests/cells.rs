//! One cell per location (issue 15, item 3). Every copy records the cell that published it (the
//! UID of that cell's `kube-system` namespace); a replicator never modifies, withdraws or sweeps
//! a copy another cell published, and a second cell claiming a location is refused loudly (not
//! ready, a `LocationClaimed` Event on the hub, `replicator_location_conflict 1`) and writes
//! nothing. Two locations whose copies map to one name (`web-us`@`east`, `web`@`us-east`) are
//! reported with both sources named.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec, deploy,
    fixtures::{self, CONVERGE, unique},
    replicator_process::http_get,
    wait,
};
use serde_json::json;

/// The copy annotation naming the publishing cell.
const CELL_ANNOTATION: &str = "replicator.datumapis.com/cell";

/// The UID of `cell`'s `kube-system` namespace, read by the test itself.
async fn cell_uid(env: &Environment, cell: Cluster) -> anyhow::Result<String> {
    let ns = Api::<Namespace>::all(env.client(cell).await?)
        .get("kube-system")
        .await?;
    Ok(ns.uid().unwrap_or_default())
}

/// Waits for an Event of `reason` in `namespace` of `client` about object `name`; returns its note.
async fn event_note(client: &Client, namespace: &str, name: &str, reason: &str) -> anyhow::Result<String> {
    let events = Api::<Event>::namespaced(client.clone(), namespace);
    Ok(wait::until(CONVERGE, &format!("a {reason} Event on {name}"), || async {
        let list = events.list(&ListParams::default()).await?;
        Ok::<_, kube::Error>(list.items.into_iter().find_map(|e| {
            let about = e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name);
            (about && e.reason.as_deref() == Some(reason)).then(|| e.note.unwrap_or_default())
        }))
    })
    .await?)
}

fn slice(ns: &str, name: &str, address: &str) -> serde_json::Value {
    fixtures::galactic_slice(ns, name, json!([fixtures::pod_endpoint(address, name)]), None)
}

#[tokio::test]
async fn a_second_cell_claiming_a_location_is_refused_and_touches_nothing() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("cells"), unique("loc"));
    let mut teardown = deploy::Teardown::new(&env, &[&loc]).await?;
    for cluster in [HUB, CELL_A, CELL_B] {
        teardown.namespace(cluster, &ns);
    }
    fixtures::routed_namespace(&env, &ns).await?;
    let (a, b, hub) = (
        env.client(CELL_A).await?,
        env.client(CELL_B).await?,
        env.client(HUB).await?,
    );
    let es = fixtures::resource("endpointslices")?;
    let (uid_a, uid_b) = (cell_uid(&env, CELL_A).await?, cell_uid(&env, CELL_B).await?);
    assert_ne!(uid_a, uid_b);

    // cell-a publishes the location; its copy records cell-a.
    let mut first = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_A).location(&loc)).await?;
    first.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(&a, &es, &slice(&ns, "pod-a", "fd20::a")).await?;
    let copy_a = copy_name(&ns, "pod-a", &loc);
    let published = fixtures::wait_for(&hub, &es, &ns, &copy_a, CONVERGE, "cell-a's copy", |_| true).await?;
    assert_eq!(published.annotations().get(CELL_ANNOTATION), Some(&uid_a));

    // cell-b is started with the same location (and writes unconditionally: no shared Lease
    // to hide behind). Its cell has another source, and none of the name of cell-a's copy,
    // which its sweep would take for an orphan.
    fixtures::apply(&b, &es, &slice(&ns, "pod-b", "fd20::b")).await?;
    let second = ReplicatorProcess::spawn(
        &env,
        ReplicatorSpec::new(CELL_B).location(&loc).arg("--leader-elect=false"),
    )
    .await?;
    let conflict = [("location", loc.as_str())];
    wait::until(CONVERGE, "cell-b to report the conflict", || async {
        Ok::<_, replicator_e2e::Error>(
            second
                .metric("replicator_location_conflict", &conflict)
                .await?
                .filter(|v| *v == 1.0),
        )
    })
    .await?;
    let (status, body) = http_get(&format!("{}/readyz", second.health_url())).await?;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("published by another cell") && body.contains(&uid_a),
        "readyz names the other cell: {body}"
    );
    let note = event_note(&hub, &ns, &copy_a, "LocationClaimed").await?;
    assert!(note.contains(&uid_a) && note.contains(&uid_b), "{note}");
    assert_eq!(
        first.metric("replicator_location_conflict", &conflict).await?,
        Some(0.0),
        "the first cell goes on"
    );

    // Nothing written, nothing deleted: cell-a's copy is as it was, cell-b's source has no copy.
    let after = fixtures::get(&hub, &es, &ns, &copy_a)
        .await?
        .expect("cell-a's copy stays");
    assert_eq!(after.resource_version(), published.resource_version());
    assert!(
        fixtures::get(&hub, &es, &ns, &copy_name(&ns, "pod-b", &loc))
            .await?
            .is_none()
    );
    for op in ["create", "update", "delete", "replace"] {
        let labels = [("kind", "EndpointSlice"), ("location", loc.as_str()), ("op", op)];
        assert_eq!(second.metric("replicator_writes_total", &labels).await?, None, "{op}");
    }
    let sweeps = second
        .counter(
            "replicator_sweep_deleted_total",
            &[("kind", "EndpointSlice"), ("location", &loc)],
        )
        .await?;
    assert_eq!(sweeps, 0.0, "cell-b swept nothing");

    // cell-a's source goes: cell-a withdraws its copy, no other cell's copy is left under the
    // location, and cell-b publishes.
    fixtures::delete(&a, &es, &ns, "pod-a").await?;
    fixtures::wait_gone(&hub, &es, &ns, &copy_a, CONVERGE).await?;
    let copy_b = fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-b", &loc),
        CONVERGE,
        "cell-b's copy once the location is free",
        |_| true,
    )
    .await?;
    assert_eq!(copy_b.annotations().get(CELL_ANNOTATION), Some(&uid_b));
    assert_eq!(
        second.metric("replicator_location_conflict", &conflict).await?,
        Some(0.0)
    );
    drop((first, second));
    teardown.finish(&env).await?;
    Ok(())
}

#[tokio::test]
async fn two_locations_whose_copies_share_a_name_are_reported_with_both_sources() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    // `web-us`@`e<x>` and `web`@`us-e<x>` both map to `web-us-e<x>`.
    let ns = unique("names");
    let east = unique("e");
    let us_east = format!("us-{east}");
    let mut teardown = deploy::Teardown::new(&env, &[&east, &us_east]).await?;
    for cluster in [HUB, CELL_A, CELL_B] {
        teardown.namespace(cluster, &ns);
    }
    fixtures::routed_namespace(&env, &ns).await?;
    let (a, b, hub) = (
        env.client(CELL_A).await?,
        env.client(CELL_B).await?,
        env.client(HUB).await?,
    );
    let es = fixtures::resource("endpointslices")?;
    let name = copy_name(&ns, "web-us", &east);
    assert_eq!(
        name,
        copy_name(&ns, "web", &us_east),
        "the two sources share a copy name"
    );

    let mut first = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_A).location(&east)).await?;
    first.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(&a, &es, &slice(&ns, "web-us", "fd20::1")).await?;
    let kept = fixtures::wait_for(&hub, &es, &ns, &name, CONVERGE, "the first copy", |_| true).await?;

    let mut second = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_B).location(&us_east)).await?;
    second.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(&b, &es, &slice(&ns, "web", "fd20::2")).await?;
    let labels = [
        ("kind", "EndpointSlice"),
        ("location", us_east.as_str()),
        ("class", "not_ours"),
    ];
    wait::until(CONVERGE, "the collision counted", || async {
        Ok::<_, replicator_e2e::Error>(
            second
                .metric("replicator_errors_total", &labels)
                .await?
                .filter(|n| *n >= 1.0),
        )
    })
    .await?;
    let note = event_note(&b, &ns, "web", "HubNameTaken").await?;
    for named in [
        format!("{ns}/web-us"),
        format!("location {east}"),
        format!("{ns}/web "),
        us_east.clone(),
    ] {
        assert!(note.contains(&named), "the Event names {named:?}: {note}");
    }
    let after = fixtures::get(&hub, &es, &ns, &name)
        .await?
        .expect("the first copy stays");
    assert_eq!(after.resource_version(), kept.resource_version(), "never overwritten");
    assert_eq!(after.data["endpoints"][0]["addresses"], json!(["fd20::1"]));
    drop((first, second));
    teardown.finish(&env).await?;
    Ok(())
}

/// The holder of Lease `replicator-<location>` of bare processes (namespace of the harness
/// identities), if any.
async fn lease_holder(hub: &Client, location: &str) -> anyhow::Result<Option<String>> {
    let leases =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(hub.clone(), replicator_e2e::rbac::NAMESPACE);
    Ok(leases
        .get_opt(&format!("replicator-{location}"))
        .await?
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty()))
}

#[tokio::test]
async fn a_refused_cell_leaves_the_location_lease_to_the_cell_that_publishes_it() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("lease"), unique("loc"));
    let mut teardown = deploy::Teardown::new(&env, &[&loc]).await?;
    for cluster in [HUB, CELL_A, CELL_B] {
        teardown.namespace(cluster, &ns);
    }
    fixtures::routed_namespace(&env, &ns).await?;
    let (a, b, hub) = (
        env.client(CELL_A).await?,
        env.client(CELL_B).await?,
        env.client(HUB).await?,
    );
    let es = fixtures::resource("endpointslices")?;
    let first_spec = || ReplicatorSpec::new(CELL_A).location(&loc).identity(format!("{loc}-a"));

    let mut first = ReplicatorProcess::spawn(&env, first_spec()).await?;
    first.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(&a, &es, &slice(&ns, "pod-a", "fd20::a")).await?;
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-a", &loc),
        CONVERGE,
        "cell-a's copy",
        |_| true,
    )
    .await?;
    // Stopped cleanly: the Lease is free for whoever comes next.
    first.terminate(Duration::from_secs(10)).await?;

    // cell-b, same location, elects as usual: it finds cell-a's copies and stays out of the
    // election (or leaves it, if it took the free Lease before its copies listed).
    fixtures::apply(&b, &es, &slice(&ns, "pod-b", "fd20::b")).await?;
    let second = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_B).location(&loc)).await?;
    let location = [("location", loc.as_str())];
    wait::until(CONVERGE, "cell-b refused and not holding the Lease", || async {
        let conflict = second.metric("replicator_location_conflict", &location).await?;
        let leader = second.metric("replicator_leader", &location).await?;
        let holder = lease_holder(&hub, &loc)
            .await
            .map_err(|e| replicator_e2e::Error::Scenario(e.to_string()))?;
        Ok::<_, replicator_e2e::Error>(
            (conflict == Some(1.0) && leader == Some(0.0) && holder.as_deref() != Some(second.identity()))
                .then_some(()),
        )
    })
    .await?;

    // cell-a comes back and takes the Lease at once: it publishes while cell-b stays refused.
    let mut first = ReplicatorProcess::spawn(&env, first_spec()).await?;
    first.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(&a, &es, &slice(&ns, "pod-a2", "fd20::a2")).await?;
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-a2", &loc),
        CONVERGE,
        "cell-a writes again",
        |_| true,
    )
    .await?;
    assert_eq!(lease_holder(&hub, &loc).await?.as_deref(), Some(first.identity()));
    assert_eq!(
        second.metric("replicator_location_conflict", &location).await?,
        Some(1.0)
    );
    assert!(
        fixtures::get(&hub, &es, &ns, &copy_name(&ns, "pod-b", &loc))
            .await?
            .is_none()
    );
    drop((first, second));
    teardown.finish(&env).await?;
    Ok(())
}
