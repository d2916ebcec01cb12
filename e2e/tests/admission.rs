//! Hub admission (issue #18 §2–§3): the hub itself refuses what a replicator identity may not
//! write. Every request here is made to the real hub apiserver as a real service-account token
//! (`replicator-dfw`, the harness's identity of location `dfw`, bound as
//! `config/rbac/hub/location` binds one; `replicator-membership`), and each refusal is the
//! apiserver's 403 from the admission policies of `config/rbac/hub/admission_policy.yaml` (as
//! the harness installs them, names suffixed `-e2e`), recognised by the policy's message, never
//! a client-side check. Beside every refusal stands an allowed control of the same verb, so a
//! refusal cannot come from a missing RBAC grant or an unreachable hub.
//!
//! Refused as location `dfw`: creating a copy labelled with another location, one labelled
//! `dfw` whose name lacks `-dfw`, and an unlabelled object; patching, relabelling and deleting
//! another location's copy; relabelling and deleting a hand-made EndpointSlice; changing the
//! publishing-cell annotation of its own copy; taking another location's Lease; an Event about
//! another location's copy. Refused as membership: creating, patching, relabelling and deleting
//! an EndpointSlice it does not own (a location's copy, a hand-made slice), taking over an
//! unowned slice by adding its label, giving its own slice away, and taking a location's Lease
//! (a NetworkService's spec is RBAC's to refuse: membership's role grants only its status).
//!
//! Each scenario works in a hub namespace of its own (kept from Karmada's propagation) that a
//! [`Teardown`] removes, pass or fail; the objects the identities were refused never exist, and
//! the allowed controls live in that namespace.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use replicator::copy::CELL_ANNOTATION;
use replicator::rules::LOCATION_LABEL;
use replicator_e2e::fixtures::{self, Teardown, unique};
use replicator_e2e::{Environment, HUB, rbac};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The location whose identity makes the requests.
const OWN: &str = "dfw";
/// Another location, whose copies `OWN` must not touch.
const OTHER: &str = "sjc";
/// The label membership's slices carry (before and after any write it makes).
const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
const MEMBERSHIP_MANAGER: &str = "membership.replicator.datumapis.com";

/// A client of the hub that authenticates with the kubeconfig at `path`.
async fn client_from(path: &Path) -> Client {
    replicator_e2e::kubeconfig::client(path).await.unwrap()
}

/// A hub namespace of the scenario's own, which Karmada leaves on the hub.
async fn scenario_namespace(env: &Environment, teardown: &mut Teardown, prefix: &str) -> String {
    let name = unique(prefix);
    teardown.namespace(&[HUB], &name);
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {rbac::KARMADA_SKIP_PROPAGATION_LABEL: "true"}}
    }))
    .unwrap();
    Api::<Namespace>::all(env.client(HUB).await.unwrap())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    name
}

/// Asserts that `result` is the hub's 403 from admission policy `policy` with a message
/// containing `fragment`.
#[track_caller]
fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>, policy: &str, fragment: &str) {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{what}: {status:?}");
            // The harness's `<policy>-e2e`, or the shipped `<policy>` while a deployed scenario
            // has config/rbac/hub applied: the same rules.
            let installed = format!("ValidatingAdmissionPolicy '{policy}");
            assert!(
                status.message.contains(&installed),
                "{what}: refused, but not by {installed}: {}",
                status.message
            );
            assert!(
                status.message.contains(fragment),
                "{what}: the message does not say {fragment:?}: {}",
                status.message
            );
        }
        other => panic!("{what}: the hub did not refuse it: {other:?}"),
    }
}

fn endpoint_slice_resource() -> ApiResource {
    ApiResource::erase::<k8s_openapi::api::discovery::v1::EndpointSlice>(&())
}

fn network_resource() -> ApiResource {
    fixtures::resource("networks").unwrap()
}

/// An EndpointSlice with `labels`.
fn slice(ns: &str, name: &str, labels: &BTreeMap<&str, &str>) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "addressType": "IPv6",
        "endpoints": [{"addresses": ["fd20::1"]}],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }))
    .unwrap()
}

/// A Network copy of `location` (label and annotation as `replicator run` writes them).
fn network_copy(ns: &str, name: &str, location: &str) -> DynamicObject {
    let mut value = fixtures::network(ns, name);
    value["metadata"]["labels"] = json!({LOCATION_LABEL: location});
    value["metadata"]["annotations"] = json!({CELL_ANNOTATION: format!("cell-of-{location}")});
    serde_json::from_value(value).unwrap()
}

fn merge(value: Value) -> Patch<Value> {
    Patch::Merge(value)
}

#[tokio::test]
async fn a_location_identity_writes_only_its_own_copies_lease_and_events() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ids = env.least_privilege().await?;
    let mut teardown = Teardown::new(&env);
    let ns = scenario_namespace(&env, &mut teardown, "admission-loc").await;
    let admin = env.client(HUB).await?;
    let dfw = client_from(&ids.hub_kubeconfig_for(&env, OWN).await?).await;
    let (networks, slices) = (network_resource(), endpoint_slice_resource());
    let admin_networks = Api::<DynamicObject>::namespaced_with(admin.clone(), &ns, &networks);
    let admin_slices = Api::<DynamicObject>::namespaced_with(admin.clone(), &ns, &slices);
    let dfw_networks = Api::<DynamicObject>::namespaced_with(dfw.clone(), &ns, &networks);
    let dfw_slices = Api::<DynamicObject>::namespaced_with(dfw.clone(), &ns, &slices);
    let pp = PostParams::default();
    let patch = PatchParams::default();
    const POLICY: &str = "replicator-location";

    // Allowed: its own copy (label dfw, name ending -dfw), patched and deleted again.
    let own = dfw_networks.create(&pp, &network_copy(&ns, "web-dfw", OWN)).await?;
    assert_eq!(own.metadata.labels.as_ref().unwrap()[LOCATION_LABEL], OWN);
    dfw_networks
        .patch("web-dfw", &patch, &merge(json!({"spec": {"mtu": 1400}})))
        .await?;

    // Create: another location's label, a name without the suffix, no label at all.
    refused(
        "create a copy labelled sjc",
        dfw_networks.create(&pp, &network_copy(&ns, "web-sjc", OTHER)).await,
        POLICY,
        "may create only copies labelled replicator.datumapis.com/location=dfw",
    );
    refused(
        "create a dfw copy named without -dfw",
        dfw_networks.create(&pp, &network_copy(&ns, "web", OWN)).await,
        POLICY,
        "ends in -dfw; web does not",
    );
    let mut unlabelled = network_copy(&ns, "bare-dfw", OWN);
    unlabelled.metadata.labels = None;
    refused(
        "create an unlabelled object",
        dfw_networks.create(&pp, &unlabelled).await,
        POLICY,
        "has no location label",
    );

    // Another location's copy, made by its own writer (admin here).
    admin_networks.create(&pp, &network_copy(&ns, "app-sjc", OTHER)).await?;
    refused(
        "patch sjc's copy",
        dfw_networks
            .patch("app-sjc", &patch, &merge(json!({"spec": {"mtu": 1280}})))
            .await,
        POLICY,
        "is labelled sjc",
    );
    refused(
        "relabel sjc's copy as dfw",
        dfw_networks
            .patch(
                "app-sjc",
                &patch,
                &merge(json!({"metadata": {"labels": {LOCATION_LABEL: OWN}}})),
            )
            .await,
        POLICY,
        "ends in -dfw; app-sjc does not",
    );
    // Even one whose name would pass as a dfw copy (an sjc source named `lb-dfw...` is not
    // possible, but a hand-made one is).
    admin_networks.create(&pp, &network_copy(&ns, "lb-dfw", OTHER)).await?;
    refused(
        "relabel an sjc-labelled object named like a dfw copy",
        dfw_networks
            .patch(
                "lb-dfw",
                &patch,
                &merge(json!({"metadata": {"labels": {LOCATION_LABEL: OWN}}})),
            )
            .await,
        POLICY,
        "may not take over",
    );
    assert_eq!(
        admin_networks.get("lb-dfw").await?.metadata.labels.as_ref().unwrap()[LOCATION_LABEL],
        OTHER
    );
    refused(
        "delete sjc's copy",
        dfw_networks.delete("app-sjc", &DeleteParams::default()).await,
        POLICY,
        "may delete only copies labelled replicator.datumapis.com/location=dfw",
    );
    // Untouched.
    let kept = admin_networks.get("app-sjc").await?;
    assert_eq!(kept.data["spec"]["mtu"], 1460);
    assert_eq!(kept.metadata.labels.as_ref().unwrap()[LOCATION_LABEL], OTHER);

    // A hand-made EndpointSlice (no location label): not deletable, not relabellable.
    // Named as a dfw copy would be, so that only the missing label tells them apart.
    admin_slices
        .create(&pp, &slice(&ns, "handmade-dfw", &BTreeMap::new()))
        .await?;
    refused(
        "delete a hand-made EndpointSlice",
        dfw_slices.delete("handmade-dfw", &DeleteParams::default()).await,
        POLICY,
        "has no location label",
    );
    refused(
        "label a hand-made EndpointSlice as a dfw copy",
        dfw_slices
            .patch(
                "handmade-dfw",
                &patch,
                &merge(json!({"metadata": {"labels": {LOCATION_LABEL: OWN}}})),
            )
            .await,
        POLICY,
        "which is not a copy",
    );
    assert!(
        admin_slices
            .get("handmade-dfw")
            .await?
            .metadata
            .labels
            .unwrap_or_default()
            .is_empty()
    );
    // A slice of its own is allowed, the control of the two refusals above.
    let own_slice = BTreeMap::from([(LOCATION_LABEL, OWN)]);
    dfw_slices.create(&pp, &slice(&ns, "pods-dfw", &own_slice)).await?;
    dfw_slices.delete("pods-dfw", &DeleteParams::default()).await?;

    // The publishing cell of its own copy never changes.
    refused(
        "change the publishing cell of its own copy",
        dfw_networks
            .patch(
                "web-dfw",
                &patch,
                &merge(json!({"metadata": {"annotations": {CELL_ANNOTATION: "another-cell"}}})),
            )
            .await,
        POLICY,
        "never changes",
    );

    // Leases: only replicator-dfw, in the Leases' namespace.
    let dfw_leases = Api::<Lease>::namespaced(dfw.clone(), rbac::NAMESPACE);
    let lease = |name: &str| -> Lease { serde_json::from_value(json!({"metadata": {"name": name}})).unwrap() };
    let taken = dfw_leases.create(&pp, &lease("replicator-sjc")).await;
    if taken.is_ok() {
        // Never leave a stolen Lease behind for the other location.
        let _ = Api::<Lease>::namespaced(admin.clone(), rbac::NAMESPACE)
            .delete("replicator-sjc", &DeleteParams::default())
            .await;
    }
    refused(
        "take sjc's Lease",
        taken,
        POLICY,
        "may take only Lease replicator-dfw, not replicator-sjc",
    );

    // Events: about its own copies only.
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(dfw.clone(), &ns);
    let event = |name: &str, about: &str| -> k8s_openapi::api::events::v1::Event {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "eventTime": "2026-12-01T00:00:00.000000Z",
            "reportingController": "replicator.datumapis.com/run",
            "reportingInstance": "admission-test",
            "action": "Publish", "reason": "Test", "type": "Normal", "note": "admission test",
            "regarding": {"apiVersion": "networking.datumapis.com/v1alpha", "kind": "Network",
                          "namespace": ns, "name": about},
        }))
        .unwrap()
    };
    events.create(&pp, &event("about-own", "web-dfw")).await?;
    refused(
        "an Event about sjc's copy",
        events.create(&pp, &event("about-other", "app-sjc")).await,
        POLICY,
        "may only report Events about copies of location dfw",
    );

    // And its own copy goes.
    dfw_networks.delete("web-dfw", &DeleteParams::default()).await?;
    Ok(())
}

#[tokio::test]
async fn membership_writes_only_its_own_slices_service_status_and_its_lease() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ids = env.least_privilege().await?;
    let mut teardown = Teardown::new(&env);
    let ns = scenario_namespace(&env, &mut teardown, "admission-mem").await;
    let admin = env.client(HUB).await?;
    let membership = client_from(&ids.membership_kubeconfig()).await;
    let slices = endpoint_slice_resource();
    let admin_slices = Api::<DynamicObject>::namespaced_with(admin.clone(), &ns, &slices);
    let own_slices = Api::<DynamicObject>::namespaced_with(membership.clone(), &ns, &slices);
    let pp = PostParams::default();
    let patch = PatchParams::default();
    const POLICY: &str = "replicator-membership";
    let managed = BTreeMap::from([(MANAGED_BY, MEMBERSHIP_MANAGER)]);

    // Allowed: a slice of its own, patched and deleted.
    own_slices.create(&pp, &slice(&ns, "web-http", &managed)).await?;
    own_slices
        .patch(
            "web-http",
            &patch,
            &merge(json!({"endpoints": [{"addresses": ["fd20::2"]}]})),
        )
        .await?;

    // Creating a slice without its label.
    refused(
        "create a slice it would not own",
        own_slices.create(&pp, &slice(&ns, "web-other", &BTreeMap::new())).await,
        POLICY,
        "may create only EndpointSlices managed by membership.replicator.datumapis.com",
    );
    // A location's copy and a hand-made slice.
    let copy = BTreeMap::from([(LOCATION_LABEL, OWN)]);
    admin_slices.create(&pp, &slice(&ns, "pods-dfw", &copy)).await?;
    admin_slices
        .create(&pp, &slice(&ns, "handmade", &BTreeMap::new()))
        .await?;
    for name in ["pods-dfw", "handmade"] {
        refused(
            &format!("patch {name}"),
            own_slices
                .patch(name, &patch, &merge(json!({"endpoints": [{"addresses": ["fd20::9"]}]})))
                .await,
            POLICY,
            "may update only EndpointSlices managed by membership.replicator.datumapis.com",
        );
        refused(
            &format!("take {name} over by labelling it"),
            own_slices
                .patch(
                    name,
                    &patch,
                    &merge(json!({"metadata": {"labels": {MANAGED_BY: MEMBERSHIP_MANAGER}}})),
                )
                .await,
            POLICY,
            "may update only EndpointSlices managed by membership.replicator.datumapis.com",
        );
        refused(
            &format!("delete {name}"),
            own_slices.delete(name, &DeleteParams::default()).await,
            POLICY,
            "may delete only EndpointSlices managed by membership.replicator.datumapis.com",
        );
        let kept = admin_slices.get(name).await?;
        assert_eq!(kept.data["endpoints"][0]["addresses"][0], "fd20::1", "{name} untouched");
    }
    // Nor can it give away one of its own (drop the label on update).
    refused(
        "remove its label from its own slice",
        own_slices
            .patch(
                "web-http",
                &patch,
                &merge(json!({"metadata": {"labels": {MANAGED_BY: "someone-else"}}})),
            )
            .await,
        POLICY,
        "may update only EndpointSlices managed by membership.replicator.datumapis.com",
    );

    // Leases: its own (any name but a location's) in the Leases' namespace; not a location's.
    let leases = Api::<Lease>::namespaced(membership.clone(), rbac::NAMESPACE);
    let taken = leases
        .create(
            &pp,
            &serde_json::from_value::<Lease>(json!({"metadata": {"name": "replicator-dfw"}})).unwrap(),
        )
        .await;
    if taken.is_ok() {
        let _ = Api::<Lease>::namespaced(admin.clone(), rbac::NAMESPACE)
            .delete("replicator-dfw", &DeleteParams::default())
            .await;
    }
    refused(
        "take dfw's Lease",
        taken,
        POLICY,
        "Lease replicator-dfw is a location's",
    );

    own_slices.delete("web-http", &DeleteParams::default()).await?;
    Ok(())
}
