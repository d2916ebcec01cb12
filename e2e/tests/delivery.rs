//! Delivery through a real Karmada hub (issue 3, §3; issue 4, §3 last bullet): copies written by
//! `replicator run` and slices written by `replicator membership` reach the member clusters the
//! committed `policies/policies.yaml` names, and nothing delivered back is mirrored again.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kube::{Api, ResourceExt, api::DynamicObject};
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, EDGE_1, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, unique},
    paths, wait,
};
use serde_json::json;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Karmada needs a scheduling round and a Work per member; generous on a 2-core machine.
const DELIVER: Duration = Duration::from_secs(60);

/// Applies the shipped Karmada policies; `teardown` removes them again.
async fn apply_policies(env: &Environment, teardown: &mut fixtures::Teardown) {
    let file = paths::workspace_root().join("policies").join("policies.yaml");
    teardown.hub_manifest(&file);
    env.kubectl_ok(
        HUB,
        [
            "apply",
            "--server-side",
            "--field-manager=replicator-e2e",
            "-f",
            &file.display().to_string(),
        ],
    )
    .await
    .unwrap();
}

async fn start(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut p = ReplicatorProcess::spawn(env, spec).await.unwrap();
    p.wait_ready(Duration::from_secs(60)).await.unwrap();
    p
}

fn cell_spec(cell: Cluster) -> ReplicatorSpec {
    ReplicatorSpec::new(cell)
        .location(cell.location().unwrap())
        .args(["--sweep-interval", "3s"])
}

async fn names_on(
    env: &Environment,
    cluster: Cluster,
    resource: &kube::discovery::ApiResource,
    ns: &str,
) -> Vec<String> {
    let api = Api::<DynamicObject>::namespaced_with(env.client(cluster).await.unwrap(), ns, resource);
    let mut names: Vec<String> = api
        .list(&Default::default())
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
async fn a_galactic_slice_reaches_every_gateway_and_is_never_mirrored_back() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("deliver");
    let mut teardown = fixtures::Teardown::scenario(&env, &ns, &["dfw", "sjc"]);
    apply_policies(&env, &mut teardown).await;
    fixtures::routed_namespace(&env, &ns).await?;
    let es = fixtures::resource("endpointslices")?;
    let ra = start(&env, cell_spec(CELL_A)).await;
    let _rb = start(&env, cell_spec(CELL_B)).await;
    let cell_a = env.client(CELL_A).await?;
    let sid = "fc00:0:1:e000::";
    let source = fixtures::galactic_slice(
        &ns,
        "pod-a",
        json!([fixtures::pod_endpoint("fd20::a", "pod-a")]),
        Some(sid),
    );
    fixtures::apply(&cell_a, &es, &source).await?;
    let copy = copy_name(&ns, "pod-a", "dfw");
    // A 250-character pod name: its hashed copy name still leaves Karmada room to name the binding.
    let long = format!("{}-tail", "p".repeat(245));
    fixtures::apply(
        &cell_a,
        &es,
        &fixtures::galactic_slice(&ns, &long, json!([fixtures::pod_endpoint("fd20::c", "l")]), Some(sid)),
    )
    .await?;
    let long_copy = copy_name(&ns, &long, "dfw");
    fixtures::wait_for(
        &env.client(EDGE_1).await?,
        &es,
        &ns,
        &long_copy,
        DELIVER,
        "long-named copy on edge-1",
        |_| true,
    )
    .await?;
    fixtures::delete(&cell_a, &es, &ns, &long).await?;
    fixtures::wait_gone(&env.client(EDGE_1).await?, &es, &ns, &long_copy, DELIVER).await?;

    for member in [HUB, EDGE_1, CELL_B, CELL_A] {
        let client = env.client(member).await?;
        let c = fixtures::wait_for(
            &client,
            &es,
            &ns,
            &copy,
            DELIVER,
            &format!("copy on {}", member.name()),
            |_| true,
        )
        .await?;
        assert_eq!(
            c.annotations().get(fixtures::SRV6_SID_ANNOTATION).map(String::as_str),
            Some(sid),
            "SID on {}",
            member.name()
        );
        let v = serde_json::to_value(&c)?;
        assert_eq!(v["endpoints"][0]["addresses"][0], "fd20::a");
    }

    // The copies delivered into cell-a and cell-b are never sources: after two sweeps of each
    // cell, the hub still holds exactly the one copy, and no copy of a copy exists anywhere.
    wait::until(Duration::from_secs(60), "two sweeps of cell-a", || async {
        Ok::<_, replicator_e2e::Error>(
            ra.metric("replicator_sweep_runs_total", &[("location", "dfw")])
                .await?
                .filter(|n| *n >= 3.0),
        )
    })
    .await?;
    for member in [HUB, EDGE_1, CELL_B, CELL_A] {
        let names = names_on(&env, member, &es, &ns).await;
        let expected: Vec<String> = if member == CELL_A {
            vec!["pod-a".into(), copy.clone()]
        } else {
            vec![copy.clone()]
        };
        assert_eq!(names, expected, "slices in {} on {}", ns, member.name());
    }

    // Update and delete follow everywhere.
    let mut updated = source.clone();
    updated["endpoints"] = json!([fixtures::pod_endpoint("fd20::b", "pod-a")]);
    fixtures::apply(&cell_a, &es, &updated).await?;
    for member in [HUB, EDGE_1, CELL_B, CELL_A] {
        let client = env.client(member).await?;
        fixtures::wait_for(
            &client,
            &es,
            &ns,
            &copy,
            DELIVER,
            &format!("update on {}", member.name()),
            |o| {
                serde_json::to_value(o)
                    .map(|v| v["endpoints"][0]["addresses"][0] == "fd20::b")
                    .unwrap_or(false)
            },
        )
        .await?;
    }
    fixtures::delete(&cell_a, &es, &ns, "pod-a").await?;
    for member in [HUB, EDGE_1, CELL_B, CELL_A] {
        fixtures::wait_gone(&env.client(member).await?, &es, &ns, &copy, DELIVER).await?;
    }
    Ok(())
}

#[tokio::test]
async fn two_cells_publishing_the_same_name_give_two_copies_everywhere() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("twins");
    let mut teardown = fixtures::Teardown::scenario(&env, &ns, &["dfw", "sjc"]);
    apply_policies(&env, &mut teardown).await;
    fixtures::routed_namespace(&env, &ns).await?;
    let es = fixtures::resource("endpointslices")?;
    let _ra = start(&env, cell_spec(CELL_A)).await;
    let _rb = start(&env, cell_spec(CELL_B)).await;
    for (cell, addr) in [(CELL_A, "fd20::a1"), (CELL_B, "fd20::b1")] {
        let client = env.client(cell).await?;
        fixtures::apply(
            &client,
            &es,
            &fixtures::galactic_slice(&ns, "pod-x", json!([fixtures::pod_endpoint(addr, "pod-x")]), None),
        )
        .await?;
    }
    for member in [HUB, EDGE_1, CELL_A, CELL_B] {
        let client = env.client(member).await?;
        for (location, addr) in [("dfw", "fd20::a1"), ("sjc", "fd20::b1")] {
            fixtures::wait_for(
                &client,
                &es,
                &ns,
                &copy_name(&ns, "pod-x", location),
                DELIVER,
                &format!("{location} copy on {}", member.name()),
                |o| {
                    serde_json::to_value(o)
                        .map(|v| v["endpoints"][0]["addresses"][0] == addr)
                        .unwrap_or(false)
                },
            )
            .await?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn a_network_context_reaches_only_its_cell_and_a_network_stays_on_the_hub() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("ctx");
    let mut teardown = fixtures::Teardown::scenario(&env, &ns, &["dfw", "sjc"]);
    apply_policies(&env, &mut teardown).await;
    fixtures::routed_namespace(&env, &ns).await?;
    let _ra = start(&env, cell_spec(CELL_A)).await;
    let cell_a = env.client(CELL_A).await?;
    let (net, ctx) = (fixtures::resource("networks")?, fixtures::resource("networkcontexts")?);
    fixtures::apply(&cell_a, &net, &fixtures::network(&ns, "default")).await?;
    fixtures::apply(
        &cell_a,
        &ctx,
        &fixtures::network_context(&ns, "default-dfw", "default", "dfw"),
    )
    .await?;
    let ctx_copy = copy_name(&ns, "default-dfw", "dfw");
    fixtures::wait_for(
        &env.client(HUB).await?,
        &net,
        &ns,
        &copy_name(&ns, "default", "dfw"),
        DELIVER,
        "network copy",
        |_| true,
    )
    .await?;
    fixtures::wait_for(
        &cell_a,
        &ctx,
        &ns,
        &ctx_copy,
        DELIVER,
        "context delivered to its cell",
        |_| true,
    )
    .await?;

    // Karmada scheduled the context to exactly the dfw cluster.
    let bindings = env
        .kubectl_ok(
            HUB,
            ["get", "resourcebindings.work.karmada.io", "-n", &ns, "-o", "json"],
        )
        .await?;
    let bindings: serde_json::Value = serde_json::from_str(&bindings)?;
    let for_ctx: Vec<&serde_json::Value> = bindings["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| {
            b["spec"]["resource"]["kind"] == "NetworkContext" && b["spec"]["resource"]["name"] == ctx_copy.as_str()
        })
        .collect();
    assert_eq!(for_ctx.len(), 1, "one binding for the context copy");
    let clusters: Vec<&str> = for_ctx[0]["spec"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        clusters,
        vec![CELL_A.name()],
        "scheduled to the cell of its location only"
    );
    let network_bound = bindings["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["spec"]["resource"]["kind"] == "Network");
    assert!(!network_bound, "no policy selects Network copies");
    for other in [CELL_B, EDGE_1] {
        assert!(
            names_on(&env, other, &ctx, &ns).await.is_empty(),
            "context on {}",
            other.name()
        );
        assert!(
            names_on(&env, other, &net, &ns).await.is_empty(),
            "network on {}",
            other.name()
        );
    }
    Ok(())
}

#[tokio::test]
async fn network_service_slices_reach_the_gateway_clusters() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, workload) = (unique("svcdeliver"), unique("wl"));
    let mut teardown = fixtures::Teardown::scenario(&env, &ns, &["dfw", "sjc"]);
    apply_policies(&env, &mut teardown).await;
    fixtures::routed_namespace(&env, &ns).await?;
    let _ra = start(&env, cell_spec(CELL_A)).await;
    let _m = start(&env, ReplicatorSpec::membership()).await;
    let cell_a = env.client(CELL_A).await?;
    let ni = fixtures::resource("networkinterfaces")?;
    fixtures::apply(
        &cell_a,
        &ni,
        &fixtures::network_interface(&ns, "web-0", "default", "web-0", &workload, "dfw"),
    )
    .await?;
    fixtures::set_status(&cell_a, &ni, &ns, "web-0", fixtures::bound_status(true)).await?;
    let hub = env.client(HUB).await?;
    fixtures::apply(
        &hub,
        &fixtures::network_service_resource(),
        &fixtures::network_service(&ns, "api", &workload),
    )
    .await?;
    let es = fixtures::resource("endpointslices")?;
    for member in [HUB, EDGE_1, CELL_A, CELL_B] {
        let client = env.client(member).await?;
        let s = fixtures::wait_for(
            &client,
            &es,
            &ns,
            "api-http",
            DELIVER,
            &format!("service slice on {}", member.name()),
            |o| {
                serde_json::to_value(o)
                    .map(|v| v["endpoints"][0]["addresses"][0] == "fd20:0:0:1::10")
                    .unwrap_or(false)
            },
        )
        .await?;
        assert_eq!(
            s.labels().get("kubernetes.io/service-name").map(String::as_str),
            Some("api-http")
        );
    }
    Ok(())
}
