//! End-to-end scenarios of `replicator run` on the real local control plane (issue 2, §6).
//!
//! Every scenario runs real `replicator` processes against real kube-apiservers (hub, cell-a,
//! cell-b), in namespaces and under location names of its own, so scenarios never see each
//! other's copies. Waits poll a condition with a deadline; nothing sleeps to synchronise.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kube::{Api, ResourceExt, api::DynamicObject};
use replicator::{copy::copy_name, rules::LOCATION_LABEL};
use replicator_e2e::{
    CELL_A, CELL_B, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, CONVERGE, unique},
};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

async fn start(env: &Environment, cell: replicator_e2e::Cluster, location: &str, extra: &[&str]) -> ReplicatorProcess {
    let spec = ReplicatorSpec::new(cell).location(location).args(extra.iter().copied());
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(60)).await.unwrap();
    process
}

fn labels_of(o: &DynamicObject) -> std::collections::BTreeMap<String, String> {
    o.labels().clone()
}

fn json_of(o: &DynamicObject) -> Value {
    serde_json::to_value(o).unwrap()
}

/// Waits until `r` counts an error of `class` for `kind` in `location` and the cell holds an
/// Event of `reason` in `ns`; returns the Event.
async fn error_counted_with_event(
    r: &ReplicatorProcess,
    cell: &kube::Client,
    ns: &str,
    labels: &[(&str, &str)],
    reason: &str,
) -> Result<k8s_openapi::api::events::v1::Event, Box<dyn std::error::Error>> {
    replicator_e2e::wait::until(CONVERGE, &format!("an error counted with {labels:?}"), || async {
        Ok::<_, replicator_e2e::Error>(r.metric("replicator_errors_total", labels).await?.filter(|n| *n >= 1.0))
    })
    .await?;
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(cell.clone(), ns);
    let event = replicator_e2e::wait::until(CONVERGE, &format!("a {reason} event on the source"), || async {
        let list = events.list(&Default::default()).await?;
        Ok::<_, kube::Error>(list.items.into_iter().find(|e| e.reason.as_deref() == Some(reason)))
    })
    .await?;
    Ok(event)
}

#[tokio::test]
async fn create_update_and_delete_in_a_cell_reach_the_hub_copy() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("crud"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let _r = start(&env, CELL_A, &loc, &[]).await;
    let ni = fixtures::resource("networkinterfaces")?;
    let copy = copy_name(&ns, "web-0", &loc);

    let t = Instant::now();
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "web-0", "default", "web-0", "web", &loc),
    )
    .await?;
    let c = fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "copy created", |_| true).await?;
    eprintln!("create reached the hub in {:?}", t.elapsed());
    assert_eq!(c.labels().get(LOCATION_LABEL).map(String::as_str), Some(loc.as_str()));
    assert_eq!(json_of(&c)["spec"]["mtu"], 1460);

    let t = Instant::now();
    let mut updated = fixtures::network_interface(&ns, "web-0", "default", "web-0", "web", &loc);
    updated["spec"]["mtu"] = json!(9000 - 144);
    fixtures::apply(&cell, &ni, &updated).await?;
    fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "mtu update", |o| {
        json_of(o)["spec"]["mtu"] == 8856
    })
    .await?;
    eprintln!("update reached the hub in {:?}", t.elapsed());

    let t = Instant::now();
    fixtures::delete(&cell, &ni, &ns, "web-0").await?;
    fixtures::wait_gone(&hub, &ni, &ns, &copy, CONVERGE).await?;
    eprintln!("delete reached the hub in {:?}", t.elapsed());
    Ok(())
}

#[tokio::test]
async fn labels_follow_the_allow_list_and_a_dropped_label_leaves_the_copy() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("labels"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let _r = start(&env, CELL_A, &loc, &[]).await;
    let ni = fixtures::resource("networkinterfaces")?;
    let copy = copy_name(&ns, "web-1", &loc);

    let source = fixtures::network_interface(&ns, "web-1", "default", "claim-1", "web", &loc);
    fixtures::apply(&cell, &ni, &source).await?;
    let c = fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "copy", |_| true).await?;
    let labels = labels_of(&c);
    assert_eq!(
        labels.get("compute.datumapis.com/workload").map(String::as_str),
        Some("web")
    );
    assert_eq!(
        labels.get("compute.datumapis.com/instance-index").map(String::as_str),
        Some("0")
    );
    assert_eq!(
        labels.get("networking.datumapis.com/held-by").map(String::as_str),
        Some("claim-1")
    );
    assert_eq!(labels.get("networking.datumapis.com/source-namespace"), Some(&ns));
    assert_eq!(
        labels
            .get("meta.datumapis.com/upstream-cluster-name")
            .map(String::as_str),
        Some(fixtures::UPSTREAM_CLUSTER)
    );
    assert!(
        !labels.contains_key("app.kubernetes.io/name"),
        "a label outside the allow-list never arrives: {labels:?}"
    );

    let mut dropped = source.clone();
    dropped["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("compute.datumapis.com/instance-index");
    fixtures::apply(&cell, &ni, &dropped).await?;
    let c = fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "dropped label to leave", |o| {
        !o.labels().contains_key("compute.datumapis.com/instance-index")
    })
    .await?;
    assert_eq!(
        c.labels().get("compute.datumapis.com/workload").map(String::as_str),
        Some("web")
    );
    Ok(())
}

#[tokio::test]
async fn interface_copies_drop_cell_fields_and_carry_phase_and_conditions() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("proj"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let _r = start(&env, CELL_A, &loc, &[]).await;
    let ni = fixtures::resource("networkinterfaces")?;
    let copy = copy_name(&ns, "web-2", &loc);

    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "web-2", "default", "claim-2", "web", &loc),
    )
    .await?;
    fixtures::set_status(&cell, &ni, &ns, "web-2", fixtures::bound_status(true)).await?;
    let c = fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy,
        CONVERGE,
        "status Bound with HolderAvailable",
        |o| {
            let v = json_of(o);
            v["status"]["phase"] == "Bound" && v["status"]["conditions"][0]["status"] == "True"
        },
    )
    .await?;
    let v = json_of(&c);
    assert!(v["spec"].get("claimRef").is_none(), "claimRef crossed: {}", v["spec"]);
    assert!(
        v["spec"].get("attachmentMode").is_none(),
        "attachmentMode crossed: {}",
        v["spec"]
    );
    assert_eq!(v["spec"]["addresses"][0]["address"], "fd20:0:0:1::10/64");
    assert_eq!(v["status"]["conditions"][0]["type"], "HolderAvailable");
    assert_eq!(v["status"]["conditions"][1]["type"], "Programmed");
    assert!(v["status"].get("vpc").is_none());
    assert!(v["status"].get("networkContextRef").is_none());

    fixtures::set_status(&cell, &ni, &ns, "web-2", fixtures::bound_status(false)).await?;
    fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "HolderAvailable False", |o| {
        json_of(o)["status"]["conditions"][0]["status"] == "False"
    })
    .await?;

    // A carried status field the source loses is cleared on the copy, not left stale.
    fixtures::set_status(&cell, &ni, &ns, "web-2", json!({"phase": null})).await?;
    let c = fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "phase to be cleared", |o| {
        json_of(o)["status"].get("phase").is_none()
    })
    .await?;
    assert_eq!(
        json_of(&c)["status"]["conditions"][0]["status"],
        "False",
        "the conditions stay"
    );
    Ok(())
}

#[tokio::test]
async fn galactic_slices_cross_verbatim_without_owner_references() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("es"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let _r = start(&env, CELL_A, &loc, &[]).await;
    let es = fixtures::resource("endpointslices")?;

    let endpoints = json!([
        {"addresses": ["fd20::a"], "conditions": {"ready": true, "serving": true, "terminating": false},
         "targetRef": {"kind": "Pod", "name": "pod-a", "namespace": "default"}, "zone": "dfw-1"},
        {"addresses": ["fd20::b"], "conditions": {}},
        {"addresses": ["fd20::c"], "conditions": {"ready": false}}
    ]);
    let sid = "fc00:0:1:e000::\t  odd spacing ✓";
    let mut source = fixtures::galactic_slice(&ns, "pod-a", endpoints.clone(), Some(sid));
    // The owner exists: the cell runs a real garbage collector, which deletes a dependent whose
    // owner is gone (galactic's slices are owned by their pods; a ConfigMap stands in for one).
    let owner = fixtures::apply(
        &cell,
        &kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
        &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "pod-a", "namespace": ns}}),
    )
    .await?;
    source["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "pod-a",
        "uid": owner.metadata.uid.clone().unwrap_or_default()}]);
    fixtures::apply(&cell, &es, &source).await?;
    let copy = copy_name(&ns, "pod-a", &loc);
    let c = fixtures::wait_for(&hub, &es, &ns, &copy, CONVERGE, "slice copy", |_| true).await?;
    let v = json_of(&c);
    assert_eq!(
        v["endpoints"], endpoints,
        "endpoints cross verbatim (absent conditions stay absent)"
    );
    let source_ports = json_of(&fixtures::get(&cell, &es, &ns, "pod-a").await?.unwrap())["ports"].clone();
    assert_eq!(source_ports, Value::Null, "the cell serves nil ports as null");
    assert_eq!(v["ports"], Value::Null, "nil ports stay nil, never []: {v}");
    assert_eq!(v["addressType"], "IPv6");
    assert_eq!(
        c.annotations().get(fixtures::SRV6_SID_ANNOTATION).map(String::as_str),
        Some(sid)
    );
    assert_eq!(
        c.annotations().get("galactic.datum.net/tenant-id").map(String::as_str),
        Some("vpc7Xq-att9Zk")
    );
    assert!(c.owner_references().is_empty(), "owner references dropped");
    assert_eq!(
        c.labels().get("galactic.datum.net/tenant-id").map(String::as_str),
        Some("vpc7Xq-att9Zk")
    );
    Ok(())
}

#[tokio::test]
async fn a_source_deleted_while_stopped_is_collected_after_restart() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("gone"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    // Its own sources only (fixtures::scenario_rules): what the sweep collects is its own.
    let rules = fixtures::scenario_rules(&env, &ns, &["endpointslices"])?
        .display()
        .to_string();
    let scoped = ["--rules", rules.as_str()];
    let mut r = start(&env, CELL_A, &loc, &scoped).await;
    for name in ["keep", "drop"] {
        let slice = fixtures::galactic_slice(&ns, name, json!([fixtures::pod_endpoint("fd20::1", name)]), None);
        fixtures::apply(&cell, &es, &fixtures::scenario_labelled(slice)).await?;
        fixtures::wait_for(&hub, &es, &ns, &copy_name(&ns, name, &loc), CONVERGE, "copy", |_| true).await?;
    }
    r.kill().await?;
    fixtures::delete(&cell, &es, &ns, "drop").await?;
    let r = start(&env, CELL_A, &loc, &scoped).await;
    fixtures::wait_gone(&hub, &es, &ns, &copy_name(&ns, "drop", &loc), CONVERGE).await?;
    assert!(
        fixtures::get(&hub, &es, &ns, &copy_name(&ns, "keep", &loc))
            .await?
            .is_some(),
        "live source's copy kept"
    );
    let swept = r
        .metric(
            "replicator_sweep_deleted_total",
            &[("kind", "EndpointSlice"), ("location", &loc)],
        )
        .await?;
    assert_eq!(swept, Some(1.0), "the start-up sweep collected exactly the one orphan");
    Ok(())
}

#[tokio::test]
async fn copies_edited_or_deleted_on_the_hub_are_repaired_and_other_locations_untouched() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc, other) = (unique("repair"), unique("loc"), unique("other"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc, &other]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    let es = fixtures::resource("endpointslices")?;

    // Another location's copies: one of a source that does not exist in this cell.
    let mut foreign = fixtures::galactic_slice(
        &ns,
        &format!("ghost-{other}"),
        json!([fixtures::pod_endpoint("fd20::9", "g")]),
        None,
    );
    foreign["metadata"]["labels"][LOCATION_LABEL] = json!(other);
    foreign["metadata"]["annotations"]["replicator.datumapis.com/source-namespace"] = json!(ns);
    foreign["metadata"]["annotations"]["replicator.datumapis.com/source-name"] = json!("ghost");
    fixtures::apply(&hub, &es, &foreign).await?;

    let r = start(&env, CELL_A, &loc, &["--sweep-interval", "2s"]).await;
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "web-3", "default", "claim-3", "web", &loc),
    )
    .await?;
    let copy = copy_name(&ns, "web-3", &loc);
    fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "copy", |_| true).await?;

    // An owned field edited on the hub is put back.
    let t = Instant::now();
    let mut edit = json!({"apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkInterface",
        "metadata": {"name": copy, "namespace": ns}, "spec": {"network": {"name": "hijacked"}}});
    let api = Api::<DynamicObject>::namespaced_with(hub.clone(), &ns, &ni);
    api.patch(
        &copy,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&edit),
    )
    .await?;
    fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "edited field repaired", |o| {
        json_of(o)["spec"]["network"]["name"] == "default"
    })
    .await?;
    eprintln!("edit repaired in {:?}", t.elapsed());

    // A label of ours removed on the hub is put back; a label someone else adds is left alone.
    edit = json!({"metadata": {"labels": {"compute.datumapis.com/workload": null, "karmada.io/policy": "p"}}});
    api.patch(
        &copy,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&edit),
    )
    .await?;
    let c = fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "removed label repaired", |o| {
        o.labels().contains_key("compute.datumapis.com/workload")
    })
    .await?;
    assert_eq!(
        c.labels().get("karmada.io/policy").map(String::as_str),
        Some("p"),
        "foreign label kept"
    );

    // A deleted copy comes back.
    let t = Instant::now();
    fixtures::delete(&hub, &ni, &ns, &copy).await?;
    fixtures::wait_for(&hub, &ni, &ns, &copy, CONVERGE, "deleted copy recreated", |_| true).await?;
    eprintln!("deleted copy recreated in {:?}", t.elapsed());

    // Two periodic sweeps later the other location's copy is still there, untouched.
    replicator_e2e::wait::until(Duration::from_secs(30), "three sweep passes", || async {
        let n = r
            .metric("replicator_sweep_runs_total", &[("location", loc.as_str())])
            .await?;
        Ok::<_, replicator_e2e::Error>(n.filter(|n| *n >= 3.0))
    })
    .await?;
    let f = fixtures::get(&hub, &es, &ns, &format!("ghost-{other}"))
        .await?
        .expect("other location's copy is untouched");
    assert_eq!(f.labels().get(LOCATION_LABEL), Some(&other));
    Ok(())
}

#[tokio::test]
async fn an_unroutable_namespace_is_not_published_and_is_counted() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("unrouted"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::namespace(&env, &[CELL_A, HUB], &ns, false).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = start(&env, CELL_A, &loc, &[]).await;
    let net = fixtures::resource("networks")?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns, "default")).await?;
    let labels = [("kind", "Network"), ("location", loc.as_str())];
    let counted = replicator_e2e::wait::until(CONVERGE, "unroutable gauge", || async {
        Ok::<_, replicator_e2e::Error>(
            r.metric("replicator_unroutable_objects", &labels)
                .await?
                .filter(|n| *n >= 1.0),
        )
    })
    .await?;
    assert!(
        fixtures::get(&hub, &net, &ns, &copy_name(&ns, "default", &loc))
            .await?
            .is_none(),
        "unroutable source published"
    );

    // Labelling the namespace makes it routable: published, and no longer counted.
    let api = Api::<k8s_openapi::api::core::v1::Namespace>::all(cell.clone());
    let patch = json!({"metadata": {"labels": {
        "meta.datumapis.com/upstream-cluster-name": fixtures::UPSTREAM_CLUSTER,
        "meta.datumapis.com/upstream-namespace": "default"}}});
    api.patch(
        &ns,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &net,
        &ns,
        &copy_name(&ns, "default", &loc),
        CONVERGE,
        "published once routable",
        |_| true,
    )
    .await?;
    replicator_e2e::wait::until(CONVERGE, "unroutable gauge to drop", || async {
        Ok::<_, replicator_e2e::Error>(
            r.metric("replicator_unroutable_objects", &labels)
                .await?
                .filter(|n| *n == counted - 1.0),
        )
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn copies_and_karmada_managed_objects_are_never_mirrored() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("loop"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    let _r = start(&env, CELL_A, &loc, &["--sweep-interval", "2s"]).await;
    let ep = json!([fixtures::pod_endpoint("fd20::2", "p")]);
    let mut managed = fixtures::galactic_slice(&ns, "delivered", ep.clone(), None);
    managed["metadata"]["labels"]["karmada.io/managed"] = json!("true");
    fixtures::apply(&cell, &es, &managed).await?;
    let mut copy = fixtures::galactic_slice(&ns, "a-copy", ep.clone(), None);
    copy["metadata"]["labels"][LOCATION_LABEL] = json!("elsewhere");
    fixtures::apply(&cell, &es, &copy).await?;
    // A real source written after them is the barrier: once its copy is there, the others have
    // been seen and skipped.
    fixtures::apply(&cell, &es, &fixtures::galactic_slice(&ns, "barrier", ep, None)).await?;
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "barrier", &loc),
        CONVERGE,
        "barrier copy",
        |_| true,
    )
    .await?;
    let on_hub = Api::<DynamicObject>::namespaced_with(hub.clone(), &ns, &es)
        .list(&Default::default())
        .await?;
    let names: Vec<String> = on_hub.items.iter().map(ResourceExt::name_any).collect();
    assert_eq!(
        names,
        vec![copy_name(&ns, "barrier", &loc)],
        "only the real source is mirrored"
    );
    Ok(())
}

#[tokio::test]
async fn a_slice_with_zero_endpoints_is_neither_published_nor_withdrawn() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("empty"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    let _r = start(&env, CELL_A, &loc, &[]).await;

    fixtures::apply(&cell, &es, &fixtures::galactic_slice(&ns, "never", json!([]), None)).await?;
    let full = fixtures::galactic_slice(&ns, "partial", json!([fixtures::pod_endpoint("fd20::3", "p")]), None);
    fixtures::apply(&cell, &es, &full).await?;
    let partial_copy = copy_name(&ns, "partial", &loc);
    fixtures::wait_for(&hub, &es, &ns, &partial_copy, CONVERGE, "copy", |_| true).await?;
    assert!(
        fixtures::get(&hub, &es, &ns, &copy_name(&ns, "never", &loc))
            .await?
            .is_none(),
        "empty slice published"
    );

    // The published slice loses its endpoints: the copy stays as it was. A later change to
    // another source is the barrier proving the empty update was processed.
    let mut emptied = full.clone();
    emptied["endpoints"] = json!([]);
    fixtures::apply(&cell, &es, &emptied).await?;
    fixtures::apply(
        &cell,
        &es,
        &fixtures::galactic_slice(&ns, "barrier", json!([fixtures::pod_endpoint("fd20::4", "b")]), None),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "barrier", &loc),
        CONVERGE,
        "barrier copy",
        |_| true,
    )
    .await?;
    let kept = fixtures::get(&hub, &es, &ns, &partial_copy)
        .await?
        .expect("copy withdrawn on zero endpoints");
    assert_eq!(json_of(&kept)["endpoints"][0]["addresses"][0], "fd20::3");
    Ok(())
}

#[tokio::test]
async fn a_250_character_source_name_yields_a_valid_unique_stable_copy_name() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("long"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    let mut r = start(&env, CELL_A, &loc, &[]).await;
    let stem = "p".repeat(245);
    let names = [format!("{stem}-aaaa"), format!("{stem}-bbbb")];
    for name in &names {
        assert_eq!(name.len(), 250);
        fixtures::apply(
            &cell,
            &es,
            &fixtures::galactic_slice(&ns, name, json!([fixtures::pod_endpoint("fd20::5", "p")]), None),
        )
        .await?;
    }
    let copies: Vec<String> = names.iter().map(|n| copy_name(&ns, n, &loc)).collect();
    assert_ne!(copies[0], copies[1]);
    for c in &copies {
        assert!(c.len() <= 253 && c.ends_with(&format!("-{loc}")), "{c}");
        fixtures::wait_for(&hub, &es, &ns, c, CONVERGE, "hashed copy", |_| true).await?;
    }
    // Stable across restarts: the restarted process finds the same copies in sync and writes
    // neither (their resourceVersions do not move).
    let mut versions = Vec::new();
    for c in &copies {
        versions.push(fixtures::get(&hub, &es, &ns, c).await?.unwrap().resource_version());
    }
    r.kill().await?;
    let r = start(&env, CELL_A, &loc, &[]).await;
    // A source written after the restart is the barrier: once its copy exists, the keys
    // queued at start-up before it have been processed.
    fixtures::apply(
        &cell,
        &es,
        &fixtures::galactic_slice(&ns, "after", json!([fixtures::pod_endpoint("fd20::6", "a")]), None),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "after", &loc),
        CONVERGE,
        "barrier copy",
        |_| true,
    )
    .await?;
    let skipped = r
        .metric(
            "replicator_writes_total",
            &[("kind", "EndpointSlice"), ("location", loc.as_str()), ("op", "skipped")],
        )
        .await?;
    assert!(
        skipped.unwrap_or(0.0) >= 2.0,
        "the restart verified the copies in sync: {skipped:?}"
    );
    for (c, before) in copies.iter().zip(&versions) {
        let after = fixtures::get(&hub, &es, &ns, c).await?.unwrap().resource_version();
        assert_eq!(&after, before, "{c} was rewritten by the restart");
    }
    // This location's copies only: on a long-lived environment the namespace may hold others'.
    let listed = Api::<DynamicObject>::namespaced_with(hub.clone(), &ns, &es)
        .list(&kube::api::ListParams::default().labels(&format!("{LOCATION_LABEL}={loc}")))
        .await?;
    let mut on_hub: Vec<String> = listed.items.iter().map(ResourceExt::name_any).collect();
    on_hub.sort();
    let mut expected = copies.clone();
    expected.push(copy_name(&ns, "after", &loc));
    expected.sort();
    assert_eq!(on_hub, expected, "no duplicate copies after restart");
    Ok(())
}

#[tokio::test]
async fn two_cells_publishing_the_same_name_produce_two_copies() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc_a, loc_b) = (unique("twin"), unique("a"), unique("b"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc_a, &loc_b]);
    fixtures::routed_namespace(&env, &ns).await?;
    let hub = env.client(HUB).await?;
    let es = fixtures::resource("endpointslices")?;
    let _ra = start(&env, CELL_A, &loc_a, &["--sweep-interval", "2s"]).await;
    let _rb = start(&env, CELL_B, &loc_b, &["--sweep-interval", "2s"]).await;
    for (cell, addr) in [(CELL_A, "fd20::a1"), (CELL_B, "fd20::b1")] {
        let client = env.client(cell).await?;
        fixtures::apply(
            &client,
            &es,
            &fixtures::galactic_slice(&ns, "pod-x", json!([fixtures::pod_endpoint(addr, "pod-x")]), None),
        )
        .await?;
    }
    let a = fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-x", &loc_a),
        CONVERGE,
        "cell-a copy",
        |_| true,
    )
    .await?;
    let b = fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-x", &loc_b),
        CONVERGE,
        "cell-b copy",
        |_| true,
    )
    .await?;
    assert_eq!(json_of(&a)["endpoints"][0]["addresses"][0], "fd20::a1");
    assert_eq!(json_of(&b)["endpoints"][0]["addresses"][0], "fd20::b1");

    // Deleting in cell-a withdraws only cell-a's copy, sweeps included.
    fixtures::delete(&env.client(CELL_A).await?, &es, &ns, "pod-x").await?;
    fixtures::wait_gone(&hub, &es, &ns, &copy_name(&ns, "pod-x", &loc_a), CONVERGE).await?;
    replicator_e2e::wait::until(Duration::from_secs(30), "two more sweeps of cell-a", || async {
        let n = _ra
            .metric("replicator_sweep_runs_total", &[("location", loc_a.as_str())])
            .await?;
        Ok::<_, replicator_e2e::Error>(n.filter(|n| *n >= 3.0))
    })
    .await?;
    assert!(
        fixtures::get(&hub, &es, &ns, &copy_name(&ns, "pod-x", &loc_b))
            .await?
            .is_some(),
        "cell-b's copy untouched"
    );
    Ok(())
}

/// A hub name taken by an object that is not this location's copy (made by hand here; a
/// copy-name collision between locations is the other way it happens) is never written nor
/// deleted: the source gets a `HubNameTaken` Event and the error is counted as `not_ours`.
#[tokio::test]
async fn a_hub_name_taken_by_an_object_not_ours_is_reported_and_never_touched() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("taken"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    let taken = copy_name(&ns, "pod-t", &loc);
    let mut by_hand = fixtures::galactic_slice(&ns, &taken, json!([fixtures::pod_endpoint("fd20::aa", "h")]), None);
    by_hand["metadata"]["labels"]["made-by"] = json!("hand");
    let before = fixtures::apply(&hub, &es, &by_hand).await?;

    let r = start(&env, CELL_A, &loc, &["--sweep-interval", "2s"]).await;
    for (name, addr) in [("pod-t", "fd20::1"), ("pod-f", "fd20::2")] {
        fixtures::apply(
            &cell,
            &es,
            &fixtures::galactic_slice(&ns, name, json!([fixtures::pod_endpoint(addr, name)]), None),
        )
        .await?;
    }
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-f", &loc),
        CONVERGE,
        "the free name is published",
        |_| true,
    )
    .await?;
    let labels = [
        ("kind", "EndpointSlice"),
        ("location", loc.as_str()),
        ("class", "not_ours"),
    ];
    let event = error_counted_with_event(&r, &cell, &ns, &labels, "HubNameTaken").await?;
    assert_eq!(event.regarding.as_ref().and_then(|r| r.name.as_deref()), Some("pod-t"));

    // The source goes away: its withdrawal and the sweeps leave the hand-made object alone.
    for name in ["pod-t", "pod-f"] {
        fixtures::delete(&cell, &es, &ns, name).await?;
    }
    fixtures::wait_gone(&hub, &es, &ns, &copy_name(&ns, "pod-f", &loc), CONVERGE).await?;
    let swept = r
        .counter("replicator_sweep_runs_total", &[("location", loc.as_str())])
        .await?;
    replicator_e2e::wait::until(Duration::from_secs(30), "two more sweeps", || async {
        let n = r
            .metric("replicator_sweep_runs_total", &[("location", loc.as_str())])
            .await?;
        Ok::<_, replicator_e2e::Error>(n.filter(|n| *n >= swept + 2.0))
    })
    .await?;
    let after = fixtures::get(&hub, &es, &ns, &taken)
        .await?
        .expect("the hand-made object is still there");
    assert_eq!(after.resource_version(), before.resource_version(), "never written");
    assert_eq!(labels_of(&after).get("made-by").map(String::as_str), Some("hand"));
    assert!(!labels_of(&after).contains_key(LOCATION_LABEL));
    assert_eq!(json_of(&after)["endpoints"][0]["addresses"][0], "fd20::aa");
    Ok(())
}

#[tokio::test]
async fn a_missing_hub_kubeconfig_is_waited_for_not_ready() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("waiting"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let dir = env.dir().join("scratch").join(&loc);
    std::fs::create_dir_all(&dir)?;
    let late = dir.join("hub.kubeconfig");
    std::fs::write(&late, "")?;
    let spec = ReplicatorSpec::new(CELL_A).location(&loc).hub_kubeconfig(&late);
    let mut r = ReplicatorProcess::spawn(&env, spec).await?;
    let health = r.health_url();
    replicator_e2e::wait::until(CONVERGE, "readyz to answer 503 naming the kubeconfig", || {
        let url = format!("{health}/readyz");
        async move {
            let (code, body) = replicator_e2e::replicator_process::http_get(&url).await?;
            Ok::<_, replicator_e2e::Error>((code == 503 && body.contains("hub.kubeconfig")).then_some(()))
        }
    })
    .await?;
    assert!(r.try_exit_status()?.is_none(), "the process waits instead of exiting");
    let identity = env.least_privilege().await?.hub_kubeconfig_for(&env, &loc).await?;
    std::fs::copy(identity, &late)?;
    r.wait_ready(Duration::from_secs(60)).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let net = fixtures::resource("networks")?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns, "late")).await?;
    fixtures::wait_for(
        &hub,
        &net,
        &ns,
        &copy_name(&ns, "late", &loc),
        CONVERGE,
        "copy after the kubeconfig appeared",
        |_| true,
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_missing_hub_namespace_is_waited_for_never_created() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("nohubns"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::namespace(&env, &[CELL_A], &ns, true).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = start(&env, CELL_A, &loc, &[]).await;
    let net = fixtures::resource("networks")?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns, "default")).await?;
    replicator_e2e::wait::until(CONVERGE, "a namespace_missing error", || async {
        let n = r
            .metric(
                "replicator_errors_total",
                &[
                    ("kind", "Network"),
                    ("location", loc.as_str()),
                    ("class", "namespace_missing"),
                ],
            )
            .await?;
        Ok::<_, replicator_e2e::Error>(n.filter(|n| *n >= 1.0))
    })
    .await?;
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(hub.clone());
    assert!(
        namespaces.get_opt(&ns).await?.is_none(),
        "the replicator never creates hub namespaces"
    );
    // Created by the platform, the namespace is picked up at once, not after the backoff.
    fixtures::namespace(&env, &[HUB], &ns, true).await?;
    fixtures::wait_for(
        &hub,
        &net,
        &ns,
        &copy_name(&ns, "default", &loc),
        Duration::from_secs(10),
        "copy once the namespace exists",
        |_| true,
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_source_that_cannot_be_copied_gets_an_event_and_a_metric_and_others_flow() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("badsrc"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = start(&env, CELL_A, &loc, &[]).await;
    let ni = fixtures::resource("networkinterfaces")?;
    // A claim name longer than a label value allows: held-by cannot be set.
    // Multi-byte characters: the Event note quoting it must be cut on a character boundary.
    let long_claim = "中".repeat(400);
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "bad", "default", &long_claim, "web", &loc),
    )
    .await?;
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "good", "default", "claim", "web", &loc),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "good", &loc),
        CONVERGE,
        "the good source still flows",
        |_| true,
    )
    .await?;
    let labels = [
        ("kind", "NetworkInterface"),
        ("location", loc.as_str()),
        ("class", "source_invalid"),
    ];
    let event = error_counted_with_event(&r, &cell, &ns, &labels, "SourceInvalid").await?;
    assert_eq!(event.regarding.as_ref().and_then(|r| r.name.as_deref()), Some("bad"));
    assert!(
        event
            .note
            .as_deref()
            .unwrap_or_default()
            .contains("networking.datumapis.com/held-by"),
        "{:?}",
        event.note
    );
    assert!(
        fixtures::get(&hub, &ni, &ns, &copy_name(&ns, "bad", &loc))
            .await?
            .is_none()
    );
    // No retry loop: the error waits for the source to change. A later source is the barrier.
    // (Counted from here: uncopyable sources other scenarios left in the cell count once each.)
    let counted = r.metric("replicator_errors_total", &labels).await?;
    assert!(counted >= Some(1.0), "the error is counted: {counted:?}");
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "later", "default", "claim-2", "web", &loc),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "later", &loc),
        CONVERGE,
        "barrier copy",
        |_| true,
    )
    .await?;
    assert_eq!(
        r.metric("replicator_errors_total", &labels).await?,
        counted,
        "no retries of an uncopyable source"
    );
    // Fixing the source publishes it.
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "bad", "default", "claim-3", "web", &loc),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "bad", &loc),
        CONVERGE,
        "fixed source published",
        |_| true,
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_kind_missing_on_the_hub_does_not_stall_the_others() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("stall"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let rules = env.dir().join("scratch").join(format!("{loc}-rules.yaml"));
    std::fs::create_dir_all(rules.parent().unwrap())?;
    std::fs::write(
        &rules,
        "rules:\n  - name: vpcattachments\n    resource: {group: cloud.datumapis.com, version: v1alpha1, kind: VPCAttachment, plural: vpcattachments}\n",
    )?;
    // Admin on purpose: the scenario is about a kind whose CRD is absent (404 on list), not
    // about RBAC; the shipped roles rightly grant no VPCAttachment, which would turn it into 403.
    let spec = ReplicatorSpec::new(CELL_A)
        .admin()
        .location(&loc)
        .args(["--rules".to_owned(), rules.display().to_string()]);
    let mut r = ReplicatorProcess::spawn(&env, spec).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let net = fixtures::resource("networks")?;
    fixtures::apply(&cell, &net, &fixtures::network(&ns, "flows")).await?;
    fixtures::wait_for(
        &hub,
        &net,
        &ns,
        &copy_name(&ns, "flows", &loc),
        CONVERGE,
        "Network mirrored despite the missing kind",
        |_| true,
    )
    .await?;
    let status = r.terminate(Duration::from_secs(10)).await?;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
    Ok(())
}
