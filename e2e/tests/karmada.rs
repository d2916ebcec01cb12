//! Karmada in the loop: the hub is a real Karmada control plane and cell-a, cell-b and edge-1
//! are its push-mode members. A hand-written ClusterPropagationPolicy carries a ConfigMap from
//! the hub to every member; updates follow it and a delete on the hub removes the copies.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use replicator_e2e::fixtures::unique;
use replicator_e2e::karmada::{
    GATEWAYS_ENABLED, GATEWAYS_LABEL, LOCATION_LABEL, cluster_propagation_policy_resource, cluster_resource,
    resource_binding_resource,
};
use replicator_e2e::{CELL_A, Cluster, Environment, HUB, wait};
use serde_json::json;

/// How long Karmada may take to carry a change from the hub to a member.
const PROPAGATION: Duration = Duration::from_secs(60);

async fn environment() -> anyhow::Result<Environment> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_test_writer()
        .try_init();
    Environment::ensure_up().await.context("bringing the environment up")
}

/// A namespace on the hub, and on every member once Karmada's namespace controller has
/// propagated it.
async fn hub_namespace(env: &Environment, name: &str) -> anyhow::Result<()> {
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(env.client(HUB).await?)
        .create(&PostParams::default(), &namespace)
        .await?;
    for member in Cluster::MEMBERS {
        env.wait_on_member::<Namespace>(member, None, name, PROPAGATION, |_| true)
            .await?;
    }
    Ok(())
}

fn config_map(namespace: &str, name: &str, message: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([("message".to_owned(), message.to_owned())])),
        ..ConfigMap::default()
    }
}

fn message(config_map: &ConfigMap) -> Option<&str> {
    config_map.data.as_ref()?.get("message").map(String::as_str)
}

/// A ClusterPropagationPolicy for one ConfigMap, placed by a Cluster label selector.
async fn propagate_config_map(
    env: &Environment,
    policy: &str,
    namespace: &str,
    name: &str,
    cluster_labels: serde_json::Value,
) -> anyhow::Result<()> {
    let object = json!({
        "apiVersion": "policy.karmada.io/v1alpha1",
        "kind": "ClusterPropagationPolicy",
        "metadata": { "name": policy },
        "spec": {
            "resourceSelectors": [
                { "apiVersion": "v1", "kind": "ConfigMap", "namespace": namespace, "name": name }
            ],
            "placement": {
                "clusterAffinity": { "labelSelector": { "matchLabels": cluster_labels } }
            }
        }
    });
    Api::<DynamicObject>::all_with(env.karmada_client().await?, &cluster_propagation_policy_resource())
        .patch(
            policy,
            &PatchParams::apply("replicator-e2e").force(),
            &Patch::Apply(&object),
        )
        .await
        .with_context(|| format!("creating ClusterPropagationPolicy {policy} (validated by karmada-webhook)"))?;
    Ok(())
}

async fn delete_policy(env: &Environment, policy: &str) -> anyhow::Result<()> {
    Api::<DynamicObject>::all_with(env.karmada_client().await?, &cluster_propagation_policy_resource())
        .delete(policy, &DeleteParams::default())
        .await?;
    Ok(())
}

#[tokio::test]
async fn members_are_registered_ready_and_labelled() -> anyhow::Result<()> {
    let env = environment().await?;
    let status = env.status().await;
    ensure!(status.healthy(), "unhealthy: {status:#?}");
    let clusters: Api<DynamicObject> = Api::all_with(env.karmada_client().await?, &cluster_resource());
    let namespaces: Api<Namespace> = Api::all(env.client(HUB).await?);
    for member in Cluster::MEMBERS {
        let cluster = clusters.get(member.name()).await?;
        let labels = cluster.metadata.labels.clone().unwrap_or_default();
        ensure!(
            labels.get(GATEWAYS_LABEL).map(String::as_str) == Some(GATEWAYS_ENABLED),
            "{member}: labels {labels:?}"
        );
        ensure!(
            labels.get(LOCATION_LABEL).map(String::as_str) == member.location(),
            "{member}: labels {labels:?}"
        );
        ensure!(
            cluster.data["spec"]["syncMode"] == "Push",
            "{member}: {:?}",
            cluster.data
        );
        ensure!(
            cluster.data["spec"]["apiEndpoint"] == env.server_url(member),
            "{member}: {:?}",
            cluster.data
        );
        // The cluster controller made the member's execution namespace.
        let execution = format!("karmada-es-{member}");
        ensure!(
            namespaces.get_opt(&execution).await?.is_some(),
            "no execution namespace {execution} on the hub"
        );
    }
    ensure!(CELL_A.location() == Some("dfw") && Cluster::CellB.location() == Some("sjc"));
    Ok(())
}

#[tokio::test]
async fn a_cluster_propagation_policy_carries_a_config_map_to_every_member() -> anyhow::Result<()> {
    let env = environment().await?;
    let ns = unique("karmada-cpp");
    let mut teardown = replicator_e2e::fixtures::Teardown::scenario(&env, &ns, &[]);
    teardown.hub_object("clusterpropagationpolicies.policy.karmada.io", &ns);
    hub_namespace(&env, &ns).await?;
    let hub_config_maps: Api<ConfigMap> = Api::namespaced(env.client(HUB).await?, &ns);
    propagate_config_map(&env, &ns, &ns, "greeting", json!({ GATEWAYS_LABEL: GATEWAYS_ENABLED })).await?;
    hub_config_maps
        .create(&PostParams::default(), &config_map(&ns, "greeting", "hello"))
        .await?;

    for member in Cluster::MEMBERS {
        let copy = env
            .wait_on_member::<ConfigMap>(member, Some(&ns), "greeting", PROPAGATION, |cm| {
                message(cm) == Some("hello")
            })
            .await?;
        let labels = copy.metadata.labels.unwrap_or_default();
        ensure!(
            labels.get("karmada.io/managed").map(String::as_str) == Some("true"),
            "{member}: the copy is not marked as managed by Karmada: {labels:?}"
        );
    }
    // The webhook and the detector labelled the template on the hub with the policy's id.
    let template = hub_config_maps.get("greeting").await?;
    let labels = template.metadata.labels.unwrap_or_default();
    ensure!(
        labels.contains_key("clusterpropagationpolicy.karmada.io/permanent-id"),
        "the hub template carries no policy id: {labels:?}"
    );

    hub_config_maps
        .patch(
            "greeting",
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": { "message": "updated" } })),
        )
        .await?;
    for member in Cluster::MEMBERS {
        env.wait_on_member::<ConfigMap>(member, Some(&ns), "greeting", PROPAGATION, |cm| {
            message(cm) == Some("updated")
        })
        .await?;
    }

    // Deleting the template removes the copies (the hub's garbage collector removes the
    // binding, Karmada the Works and the member objects).
    hub_config_maps.delete("greeting", &DeleteParams::default()).await?;
    let config_maps = kube::discovery::ApiResource::erase::<ConfigMap>(&());
    for member in Cluster::MEMBERS {
        env.wait_absent_on_member(member, &config_maps, Some(&ns), "greeting", PROPAGATION)
            .await?;
    }
    delete_policy(&env, &ns).await
}

#[tokio::test]
async fn the_location_label_places_on_one_cell() -> anyhow::Result<()> {
    let env = environment().await?;
    let ns = unique("karmada-loc");
    let mut teardown = replicator_e2e::fixtures::Teardown::scenario(&env, &ns, &[]);
    teardown.hub_object("clusterpropagationpolicies.policy.karmada.io", &ns);
    hub_namespace(&env, &ns).await?;
    propagate_config_map(&env, &ns, &ns, "local", json!({ LOCATION_LABEL: "dfw" })).await?;
    Api::<ConfigMap>::namespaced(env.client(HUB).await?, &ns)
        .create(&PostParams::default(), &config_map(&ns, "local", "dfw only"))
        .await?;
    env.wait_on_member::<ConfigMap>(CELL_A, Some(&ns), "local", PROPAGATION, |_| true)
        .await?;
    // The scheduler's decision names cell-a alone.
    let bindings: Api<DynamicObject> =
        Api::namespaced_with(env.karmada_client().await?, &ns, &resource_binding_resource());
    let binding = wait::until(PROPAGATION, "the ResourceBinding of ConfigMap local", || async {
        bindings.get_opt("local-configmap").await
    })
    .await?;
    let scheduled: Vec<&str> = binding.data["spec"]["clusters"]
        .as_array()
        .map(|clusters| clusters.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    ensure!(scheduled == ["cell-a"], "scheduled to {scheduled:?}");
    for other in [Cluster::CellB, Cluster::Edge1] {
        let api: Api<ConfigMap> = Api::namespaced(env.client(other).await?, &ns);
        ensure!(api.get_opt("local").await?.is_none(), "ConfigMap local reached {other}");
    }
    delete_policy(&env, &ns).await
}
