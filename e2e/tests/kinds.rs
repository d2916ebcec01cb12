//! A kind added by configuration alone (issue 15, item 6), and tenant scoping, on the real local
//! control plane.
//!
//! Galactic's VPCAttachments are added exactly as `docs/adding-a-kind.md` tells an operator: the
//! kind's CRD in the cell and on the hub (`e2e/testdata/vpcattachments-crd.yaml`, left installed
//! like the project's own CRDs), the rules file shipped in `config/components/vpcattachments/cell`
//! passed with `--rules`, and the RBAC of the two components of `config/components/vpcattachments`
//! composed onto the shipped `config/rbac/{cell,hub}` with kustomize. The replicator runs as the
//! service accounts of that render and nothing more, so a verb missing from a component fails
//! the scenario.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use kube::api::{DynamicObject, Patch, PatchParams};
use kube::{Api, ResourceExt};
use replicator::copy::{SOURCE_NAME_ANNOTATION, SOURCE_NAMESPACE_ANNOTATION, copy_name};
use replicator::routing::{UPSTREAM_CLUSTER_LABEL, UPSTREAM_NAMESPACE_LABEL};
use replicator::rules::LOCATION_LABEL;
use replicator_e2e::fixtures::{self, CONVERGE, ComposedIdentity, IdentitySpec, Teardown, unique};
use replicator_e2e::{CELL_A, Environment, HUB, ReplicatorProcess, ReplicatorSpec, paths, wait};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The rules file an operator mounts: the one the cell component ships.
fn rules_file() -> PathBuf {
    paths::workspace_root().join("config/components/vpcattachments/cell/rules.yaml")
}

/// The CRD in cell-a and on the hub, and an identity of `location` composed of the shipped roles
/// and the VPCAttachment components (removed by `teardown`).
async fn vpc_attachments_added(env: &Environment, teardown: &mut Teardown, location: &str) -> ComposedIdentity {
    fixtures::ensure_crds(env, &[HUB, CELL_A], &fixtures::testdata("vpcattachments-crd.yaml"))
        .await
        .unwrap();
    let identity = fixtures::composed_identity(
        env,
        &IdentitySpec {
            name: &unique("vpca"),
            location,
            cell: CELL_A,
            cell_components: &["components/vpcattachments/cell"],
            hub_components: &["components/vpcattachments/hub"],
            edit_cell: None,
        },
    )
    .await
    .unwrap();
    teardown.identity(&identity);
    identity
}

/// `replicator run` for cell-a as `identity`, with the shipped VPCAttachment rules.
fn run_spec(identity: &ComposedIdentity, location: &str) -> ReplicatorSpec {
    ReplicatorSpec::new(CELL_A)
        .location(location)
        .cell_kubeconfig(&identity.cell_kubeconfig)
        .hub_kubeconfig(&identity.hub_kubeconfig)
        .arg("--rules")
        .arg(rules_file())
}

async fn spawn(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(90)).await.unwrap();
    process
}

fn json_of(o: &DynamicObject) -> Value {
    serde_json::to_value(o).unwrap()
}

fn label<'a>(o: &'a DynamicObject, key: &str) -> Option<&'a str> {
    o.labels().get(key).map(String::as_str)
}

#[tokio::test]
async fn vpc_attachments_added_by_configuration_are_mirrored_updated_repaired_and_swept() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("vpca"), unique("loc"));
    let mut teardown = Teardown::new(&env);
    teardown.namespace(&[HUB, CELL_A], &ns);
    teardown.lease(&format!("replicator-{loc}"));
    let identity = vpc_attachments_added(&env, &mut teardown, &loc).await;
    fixtures::namespace_routed_to(&env, &[HUB, CELL_A], &ns, "cluster-acme", "web").await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let va = fixtures::vpc_attachment_resource();

    // Ready means the VPCAttachment reflectors listed in the cell and on the hub: the CRDs and
    // the components' grants are in place.
    let mut r = spawn(&env, run_spec(&identity, &loc)).await;
    let labels = json!({"app": "web", "tier": "frontend"});
    let addresses = ["fd20:0:1:1::10/64", "10.10.0.10/24"];
    // An attachment without `app` is not a source of the shipped rule.
    fixtures::apply(
        &cell,
        &va,
        &fixtures::vpc_attachment(&ns, "unselected", json!({"tier": "frontend"}), "vpc-1", &addresses, "x"),
    )
    .await?;
    fixtures::apply(
        &cell,
        &va,
        &fixtures::vpc_attachment(&ns, "web-0", labels.clone(), "vpc-1", &addresses, "web-0-eth1"),
    )
    .await?;
    fixtures::set_status(
        &cell,
        &va,
        &ns,
        "web-0",
        json!({"vpc": "vpc-7f3a", "node": "cell-a", "podName": "web-0", "hostInterface": "veth7"}),
    )
    .await?;

    let copy = copy_name(&ns, "web-0", &loc);
    let c = fixtures::wait_for(&hub, &va, &ns, &copy, CONVERGE, "copy with status.vpc", |o| {
        json_of(o)["status"]["vpc"] == "vpc-7f3a"
    })
    .await?;
    let v = json_of(&c);
    assert_eq!(v["spec"]["vpc"], json!({"name": "vpc-1"}));
    assert_eq!(
        v["spec"]["interface"],
        json!({"name": "eth1", "mode": "Netns", "addresses": addresses}),
        "spec.interface crosses as it is"
    );
    assert!(
        v["spec"].get("interfaceRef").is_none(),
        "spec.interfaceRef is dropped: {}",
        v["spec"]
    );
    assert_eq!(v["status"], json!({"vpc": "vpc-7f3a"}), "only status.vpc crosses");
    assert_eq!(label(&c, "app"), Some("web"));
    assert_eq!(label(&c, "tier"), Some("frontend"));
    assert_eq!(label(&c, LOCATION_LABEL), Some(loc.as_str()));
    assert_eq!(label(&c, UPSTREAM_CLUSTER_LABEL), Some("cluster-acme"));
    assert_eq!(label(&c, UPSTREAM_NAMESPACE_LABEL), Some("web"));
    assert_eq!(
        c.annotations().get(SOURCE_NAME_ANNOTATION).map(String::as_str),
        Some("web-0")
    );
    assert!(
        fixtures::get(&hub, &va, &ns, &copy_name(&ns, "unselected", &loc))
            .await?
            .is_none(),
        "an attachment the rule does not select is not mirrored"
    );
    let kind = [("kind", "VPCAttachment"), ("location", loc.as_str())];
    wait::until(CONVERGE, "replicator_copies of VPCAttachment", || async {
        Ok::<_, replicator_e2e::Error>(r.metric("replicator_copies", &kind).await?.filter(|n| *n == 1.0))
    })
    .await?;

    // Updated: new addresses, a new VPC identifier, a label gone.
    let moved = ["fd20:0:1:2::10/64"];
    fixtures::apply(
        &cell,
        &va,
        &fixtures::vpc_attachment(&ns, "web-0", json!({"app": "web"}), "vpc-1", &moved, "web-0-eth1"),
    )
    .await?;
    fixtures::set_status(&cell, &va, &ns, "web-0", json!({"vpc": "vpc-9c01"})).await?;
    let c = fixtures::wait_for(&hub, &va, &ns, &copy, CONVERGE, "update", |o| {
        let v = json_of(o);
        v["spec"]["interface"]["addresses"] == json!(moved) && v["status"]["vpc"] == "vpc-9c01"
    })
    .await?;
    assert_eq!(label(&c, "tier"), None, "a label the source dropped leaves the copy");

    // Repaired: an owned field edited on the hub is put back, a deleted copy comes back.
    Api::<DynamicObject>::namespaced_with(hub.clone(), &ns, &va)
        .patch(
            &copy,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"interface": {"addresses": ["fd99::1/64"]}}})),
        )
        .await?;
    fixtures::wait_for(&hub, &va, &ns, &copy, CONVERGE, "edit repaired", |o| {
        json_of(o)["spec"]["interface"]["addresses"] == json!(moved)
    })
    .await?;
    let uid = fixtures::get(&hub, &va, &ns, &copy).await?.unwrap().uid();
    fixtures::delete(&hub, &va, &ns, &copy).await?;
    fixtures::wait_for(&hub, &va, &ns, &copy, CONVERGE, "deleted copy recreated", |o| {
        o.uid() != uid && json_of(o)["status"]["vpc"] == "vpc-9c01"
    })
    .await?;

    // A source that starts matching the selector is published; a watched delete withdraws it.
    fixtures::apply(
        &cell,
        &va,
        &fixtures::vpc_attachment(&ns, "unselected", json!({"app": "db"}), "vpc-1", &addresses, "x"),
    )
    .await?;
    let other = copy_name(&ns, "unselected", &loc);
    fixtures::wait_for(&hub, &va, &ns, &other, CONVERGE, "newly selected", |_| true).await?;
    fixtures::delete(&cell, &va, &ns, "unselected").await?;
    fixtures::wait_gone(&hub, &va, &ns, &other, CONVERGE).await?;

    // Swept: the source goes while the replicator is stopped; the same replica, restarted,
    // collects the copy at start-up.
    let replica = r.identity().to_owned();
    r.kill().await?;
    fixtures::delete(&cell, &va, &ns, "web-0").await?;
    fixtures::wait_gone(&cell, &va, &ns, "web-0", CONVERGE).await?;
    let r = spawn(&env, run_spec(&identity, &loc).identity(replica)).await;
    fixtures::wait_gone(&hub, &va, &ns, &copy, CONVERGE).await?;
    assert_eq!(
        r.metric("replicator_sweep_deleted_total", &kind).await?,
        Some(1.0),
        "the sweep collected it"
    );
    Ok(())
}

/// The routing labels a copy carries.
fn routing(o: &DynamicObject) -> (Option<&str>, Option<&str>) {
    (label(o, UPSTREAM_CLUSTER_LABEL), label(o, UPSTREAM_NAMESPACE_LABEL))
}

#[tokio::test]
async fn tenants_with_same_named_sources_stay_in_their_own_projects() -> TestResult {
    let env = Environment::ensure_up().await?;
    let loc = unique("loc");
    let tenants = [
        (unique("tenant-a"), "cluster-tenant-a", "proj-a", 1_u8),
        (unique("tenant-b"), "cluster-tenant-b", "proj-b", 2_u8),
    ];
    let lease = unique("e2e-membership");
    let mut teardown = Teardown::new(&env);
    teardown.lease(&format!("replicator-{loc}"));
    teardown.lease(&lease);
    for (ns, ..) in &tenants {
        teardown.namespace(&[HUB, CELL_A], ns);
    }
    let identity = vpc_attachments_added(&env, &mut teardown, &loc).await;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let (va, ni) = (
        fixtures::vpc_attachment_resource(),
        fixtures::resource("networkinterfaces")?,
    );
    let _r = spawn(&env, run_spec(&identity, &loc)).await;
    let _m = spawn(
        &env,
        ReplicatorSpec::membership().args(["--lease-name", lease.as_str()]),
    )
    .await;

    // Same names in both namespaces; tenant b has one interface more than tenant a.
    let mut expected_addresses: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ns, cluster, project, n) in &tenants {
        fixtures::namespace_routed_to(&env, &[HUB, CELL_A], ns, cluster, project).await?;
        let attachment = format!("fd20:0:{n}:1::10/64");
        fixtures::apply(
            &cell,
            &va,
            &fixtures::vpc_attachment(
                ns,
                "web-0",
                json!({"app": "web"}),
                "vpc-1",
                &[&attachment],
                "web-0-eth0",
            ),
        )
        .await?;
        for i in 0..*n {
            let name = format!("web-{i}-eth0");
            let address = format!("fd20:0:{n}:1::{}", 20 + i);
            let mut interface = fixtures::network_interface(ns, &name, "default", &format!("web-{i}"), "web", &loc);
            interface["spec"]["addresses"] =
                json!([{"family": "IPv6", "address": format!("{address}/64"), "primary": true}]);
            interface["spec"].as_object_mut().unwrap().remove("externalAddresses");
            fixtures::apply(&cell, &ni, &interface).await?;
            fixtures::set_status(&cell, &ni, ns, &name, fixtures::bound_status(true)).await?;
            expected_addresses.entry(ns.clone()).or_default().push(address);
        }
        fixtures::apply(
            &hub,
            &fixtures::network_service_resource(),
            &fixtures::network_service(ns, "web", "web"),
        )
        .await?;
    }

    // Each copy is routed to its own namespace's project, under the same name in each.
    for (ns, cluster, project, n) in &tenants {
        let c = fixtures::wait_for(
            &hub,
            &va,
            ns,
            &copy_name(ns, "web-0", &loc),
            CONVERGE,
            "attachment copy",
            |_| true,
        )
        .await?;
        assert_eq!(
            routing(&c),
            (Some(*cluster), Some(*project)),
            "{ns}: routed to its own project"
        );
        assert_eq!(c.annotations().get(SOURCE_NAMESPACE_ANNOTATION), Some(ns));
        assert_eq!(
            json_of(&c)["spec"]["interface"]["addresses"],
            json!([format!("fd20:0:{n}:1::10/64")]),
            "{ns}: its own attachment's addresses"
        );
        let i = fixtures::wait_for(
            &hub,
            &ni,
            ns,
            &copy_name(ns, "web-0-eth0", &loc),
            CONVERGE,
            "interface copy",
            |_| true,
        )
        .await?;
        assert_eq!(
            routing(&i),
            (Some(*cluster), Some(*project)),
            "{ns}: interface routed to its own project"
        );
    }

    // Both services select `workload: web`, which interfaces of both namespaces carry: each
    // counts and publishes only its own namespace's.
    let svc = fixtures::network_service_resource();
    for (ns, _, _, n) in &tenants {
        let s = fixtures::wait_for(&hub, &svc, ns, "web", CONVERGE, "membership status", |o| {
            json_of(o)["status"]["summary"]["members"].as_u64() == Some(u64::from(*n))
        })
        .await?;
        let status = &json_of(&s)["status"];
        assert_eq!(status["summary"]["healthy"], json!(n), "{ns}: {status}");
        assert_eq!(status["summary"]["locations"], json!(1), "{ns}: {status}");
        let slice = Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::namespaced(hub.clone(), ns);
        let published = wait::until(
            CONVERGE,
            &format!("{ns}: slice web-http with {n} endpoints"),
            || async {
                let found = slice.get_opt("web-http").await?;
                Ok::<_, kube::Error>(found.filter(|s| s.endpoints.len() == usize::from(*n)))
            },
        )
        .await?;
        let mut addresses: Vec<String> = published
            .endpoints
            .iter()
            .flat_map(|e| e.addresses.iter().cloned())
            .collect();
        addresses.sort();
        assert_eq!(
            Some(&addresses),
            expected_addresses.get(ns),
            "{ns}: its own members' addresses only"
        );
    }
    Ok(())
}
