//! Routing follows the namespace (issue 15, item 2): the project-routing labels of a source's
//! namespace are live. A change moves the copies' routing labels; their loss withdraws the copies
//! (a copy left behind would go on being delivered to the old project), with a `Withdrawn` Event
//! on the source and the unroutable gauge; their return publishes the copies again.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use replicator::copy::copy_name;
use replicator::routing::{UPSTREAM_CLUSTER_LABEL, UPSTREAM_NAMESPACE_LABEL};
use replicator_e2e::{
    CELL_A, Environment, HUB, ReplicatorProcess, ReplicatorSpec, deploy,
    fixtures::{self, CONVERGE, UPSTREAM_CLUSTER, unique},
    wait,
};
use serde_json::{Value, json};

/// Merge-patches the labels of namespace `ns` in every client (the hub's and the cell's, as
/// Karmada would deliver them); a `null` value removes a label.
async fn label_namespace(clients: &[&Client], ns: &str, labels: Value) -> anyhow::Result<()> {
    for client in clients {
        Api::<Namespace>::all((*client).clone())
            .patch(
                ns,
                &PatchParams::default(),
                &Patch::Merge(&json!({"metadata": {"labels": labels}})),
            )
            .await?;
    }
    Ok(())
}

fn routing_of(copy: &kube::api::DynamicObject) -> (Option<String>, Option<String>) {
    (
        copy.labels().get(UPSTREAM_CLUSTER_LABEL).cloned(),
        copy.labels().get(UPSTREAM_NAMESPACE_LABEL).cloned(),
    )
}

#[tokio::test]
async fn copies_follow_their_namespace_routing_and_are_withdrawn_when_it_is_lost() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("routing"), unique("loc"));
    let mut teardown = deploy::Teardown::new(&env, &[&loc]).await?;
    for cluster in [HUB, CELL_A] {
        teardown.namespace(cluster, &ns);
    }
    fixtures::namespace(&env, &[HUB, CELL_A], &ns, true).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let (es, ni) = (
        fixtures::resource("endpointslices")?,
        fixtures::resource("networkinterfaces")?,
    );
    let mut r = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_A).location(&loc)).await?;
    r.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(
        &cell,
        &es,
        &fixtures::galactic_slice(&ns, "pod-a", json!([fixtures::pod_endpoint("fd20::1", "pod-a")]), None),
    )
    .await?;
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "nic-a", "default", "vm-a", "web", &loc),
    )
    .await?;
    let sources = [(&es, "pod-a", "EndpointSlice"), (&ni, "nic-a", "NetworkInterface")];
    let routed = |cluster: &str, namespace: &str| (Some(cluster.to_owned()), Some(namespace.to_owned()));

    for (resource, name, _) in sources {
        let copy = fixtures::wait_for(
            &hub,
            resource,
            &ns,
            &copy_name(&ns, name, &loc),
            CONVERGE,
            "copy",
            |_| true,
        )
        .await?;
        assert_eq!(routing_of(&copy), routed(UPSTREAM_CLUSTER, "default"));
    }

    // The project changes: the copies move with it.
    label_namespace(&[&hub, &cell], &ns, json!({UPSTREAM_NAMESPACE_LABEL: "moved"})).await?;
    for (resource, name, _) in sources {
        let want = routed(UPSTREAM_CLUSTER, "moved");
        let copy = fixtures::wait_for(
            &hub,
            resource,
            &ns,
            &copy_name(&ns, name, &loc),
            CONVERGE,
            "copy routed to the new project",
            |c| routing_of(c) == want,
        )
        .await?;
        assert_eq!(copy.labels().get("replicator.datumapis.com/location"), Some(&loc));
    }

    // The routing is lost: the copies are withdrawn, with an Event and the unroutable gauge.
    label_namespace(&[&hub, &cell], &ns, json!({UPSTREAM_NAMESPACE_LABEL: null})).await?;
    for (resource, name, kind) in sources {
        fixtures::wait_gone(&hub, resource, &ns, &copy_name(&ns, name, &loc), CONVERGE).await?;
        let labels = [("kind", kind), ("location", loc.as_str())];
        wait::until(CONVERGE, &format!("{kind} counted unroutable"), || async {
            Ok::<_, replicator_e2e::Error>(
                r.metric("replicator_unroutable_objects", &labels)
                    .await?
                    .filter(|n| *n == 1.0),
            )
        })
        .await?;
    }
    let events = Api::<Event>::namespaced(cell.clone(), &ns);
    let withdrawn = wait::until(CONVERGE, "a Withdrawn Event on each source", || async {
        let list = events.list(&ListParams::default()).await?;
        let mut found: Vec<(String, String)> = list
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("Withdrawn"))
            .filter_map(|e| Some((e.regarding?.name?, e.note.unwrap_or_default())))
            .collect();
        found.sort();
        Ok::<_, kube::Error>((found.len() == 2).then_some(found))
    })
    .await?;
    assert_eq!(withdrawn[0].0, "nic-a");
    assert_eq!(withdrawn[1].0, "pod-a");
    for (_, note) in &withdrawn {
        assert!(
            note.contains(UPSTREAM_NAMESPACE_LABEL),
            "the Event names the missing label: {note}"
        );
    }
    let deletes = r
        .metric(
            "replicator_writes_total",
            &[("kind", "EndpointSlice"), ("location", loc.as_str()), ("op", "delete")],
        )
        .await?;
    assert_eq!(deletes, Some(1.0), "one withdrawal of the slice copy");

    // The routing returns: published again, no longer counted.
    label_namespace(&[&hub, &cell], &ns, json!({UPSTREAM_NAMESPACE_LABEL: "back"})).await?;
    for (resource, name, kind) in sources {
        let want = routed(UPSTREAM_CLUSTER, "back");
        fixtures::wait_for(
            &hub,
            resource,
            &ns,
            &copy_name(&ns, name, &loc),
            CONVERGE,
            "copy published again",
            |c| routing_of(c) == want,
        )
        .await?;
        let labels = [("kind", kind), ("location", loc.as_str())];
        wait::until(CONVERGE, &format!("{kind} no longer unroutable"), || async {
            Ok::<_, replicator_e2e::Error>(
                r.metric("replicator_unroutable_objects", &labels)
                    .await?
                    .filter(|n| *n == 0.0),
            )
        })
        .await?;
    }
    r.terminate(Duration::from_secs(10)).await?;
    teardown.finish(&env).await?;
    Ok(())
}
