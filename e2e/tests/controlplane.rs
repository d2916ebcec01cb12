//! The local control plane itself: real kube-apiservers v1.35.4 over one etcd, isolated by etcd
//! prefix, and an apiserver outage that the harness can cause and end (after which the hub, the
//! Karmada apiserver, serves the aggregated Cluster API again).
//!
//! The tests share one environment and are serialised (the outage test stops the hub).

use std::time::Duration;

use anyhow::{Context as _, ensure};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject, ObjectMeta, PostParams};
use replicator_e2e::karmada::cluster_resource;
use replicator_e2e::wait::{self, Check};
use replicator_e2e::{CELL_A, CELL_B, Cluster, EDGE_1, Environment, HUB};

/// The environment is shared; the outage test must not overlap the others.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const DEADLINE: Duration = Duration::from_secs(60);

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

fn unique_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

fn namespace(name: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// How many etcd keys start with `key` (through etcd's JSON gateway).
async fn etcd_key_count(env: &Environment, key: &str) -> anyhow::Result<u64> {
    let body = serde_json::json!({
        "key": STANDARD.encode(key),
        "range_end": STANDARD.encode(prefix_end(key)),
        "count_only": true,
    });
    let text = reqwest::Client::builder()
        .no_proxy()
        .build()?
        .post(format!("{}/v3/kv/range", env.etcd_url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    let response: serde_json::Value = serde_json::from_str(&text)?;
    // int64 fields are JSON strings in the gateway, and omitted when zero.
    match response.get("count") {
        None => Ok(0),
        Some(serde_json::Value::String(count)) => Ok(count.parse()?),
        Some(other) => other
            .as_u64()
            .with_context(|| format!("unexpected count {other} in {response}")),
    }
}

/// The etcd range end covering every key that starts with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Deletes a namespace in a cell, where no namespace controller runs, by clearing its
/// finalizers through the `finalize` subresource; waits until it is gone.
async fn delete_namespace_without_controller(api: &Api<Namespace>, name: &str) -> anyhow::Result<()> {
    api.delete(name, &DeleteParams::default()).await?;
    let mut terminating = api.get(name).await?;
    if let Some(spec) = terminating.spec.as_mut() {
        spec.finalizers = Some(Vec::new());
    }
    api.replace_subresource("finalize", name, &PostParams::default(), &terminating)
        .await?;
    wait::until(DEADLINE, &format!("namespace {name} to be gone"), || async {
        Ok::<_, kube::Error>(api.get_opt(name).await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn ensure_up_reuses_a_healthy_environment() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let first = environment().await?;
    let second = environment().await?;
    ensure!(
        second.reused(),
        "the second ensure_up should reuse the running environment"
    );
    for cluster in Cluster::ALL {
        let (a, b) = (first.apiserver_pid(cluster).await, second.apiserver_pid(cluster).await);
        ensure!(
            a.is_some() && a == b,
            "{cluster}: apiserver pid changed from {a:?} to {b:?}"
        );
    }
    let status = second.status().await;
    ensure!(status.healthy(), "unhealthy: {status:#?}");
    Ok(())
}

#[tokio::test]
async fn clusters_serve_kubernetes_v1_35_4() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let env = environment().await?;
    for cluster in Cluster::ALL {
        let version = env.client(cluster).await?.apiserver_version().await?;
        ensure!(
            version.git_version == "v1.35.4",
            "{cluster} reports {}",
            version.git_version
        );
        ensure!(version.major == "1" && version.minor == "35", "{cluster}: {version:?}");
        let kubectl = env.kubectl_ok(cluster, ["version", "-o", "json"]).await?;
        let parsed: serde_json::Value = serde_json::from_str(&kubectl)?;
        ensure!(
            parsed["serverVersion"]["gitVersion"] == "v1.35.4" && parsed["clientVersion"]["gitVersion"] == "v1.35.4",
            "kubectl version against {cluster}: {kubectl}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn etcd_prefixes_isolate_clusters() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let env = environment().await?;
    let name = unique_name("e2e-isolation");
    let cell_a: Api<Namespace> = Api::all(env.client(CELL_A).await?);
    cell_a.create(&PostParams::default(), &namespace(&name)).await?;

    ensure!(cell_a.get_opt(&name).await?.is_some(), "cell-a lost {name}");
    for other in [CELL_B, EDGE_1, HUB] {
        let api: Api<Namespace> = Api::all(env.client(other).await?);
        ensure!(
            api.get_opt(&name).await?.is_none(),
            "namespace {name} created in cell-a is visible in {other}"
        );
    }
    let key = |cluster: Cluster| format!("{}/namespaces/{name}", cluster.etcd_prefix());
    ensure!(
        etcd_key_count(&env, &key(CELL_A)).await? == 1,
        "no etcd key {}",
        key(CELL_A)
    );
    for other in [CELL_B, EDGE_1, HUB] {
        ensure!(
            etcd_key_count(&env, &key(other)).await? == 0,
            "etcd key {} exists",
            key(other)
        );
    }
    // Each apiserver keeps its own copy of the built-in objects under its own prefix.
    for cluster in Cluster::ALL {
        let prefix = format!("{}/namespaces/default", cluster.etcd_prefix());
        ensure!(etcd_key_count(&env, &prefix).await? == 1, "no etcd key {prefix}");
    }

    delete_namespace_without_controller(&cell_a, &name).await
}

#[tokio::test]
async fn hub_outage_and_recovery() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let env = environment().await?;
    let hub = env.client(HUB).await?;
    let namespaces: Api<Namespace> = Api::all(hub.clone());
    let marker = unique_name("e2e-outage");
    namespaces.create(&PostParams::default(), &namespace(&marker)).await?;
    let pid_before = env.apiserver_pid(HUB).await.context("hub apiserver not recorded")?;

    env.stop_apiserver(HUB).await?;
    ensure!(env.apiserver_pid(HUB).await.is_none(), "stopped hub still has a pid");
    ensure!(
        tokio::net::TcpStream::connect(("127.0.0.1", env.ports().hub))
            .await
            .is_err(),
        "the hub port still accepts connections"
    );
    ensure!(
        hub.apiserver_version().await.is_err(),
        "the hub answered /version while stopped"
    );
    ensure!(
        namespaces.get_opt(&marker).await.is_err(),
        "the hub answered a GET while stopped"
    );
    let kubectl = env.kubectl(HUB, ["get", "namespaces", "--request-timeout=5s"]).await?;
    ensure!(!kubectl.status.success(), "kubectl against the stopped hub succeeded");
    for cell in Cluster::MEMBERS {
        env.client(cell)
            .await?
            .apiserver_version()
            .await
            .with_context(|| format!("{cell} should keep serving while the hub is down"))?;
    }
    let status = env.status().await;
    ensure!(!status.healthy(), "status reports healthy while the hub is down");

    env.start_apiserver(HUB).await?;
    let pid_after = env.apiserver_pid(HUB).await.context("restarted hub not recorded")?;
    ensure!(pid_after != pid_before, "the hub apiserver was not restarted");
    // The client made before the outage reconnects; the data survived in etcd.
    let version = hub.apiserver_version().await?;
    ensure!(version.git_version == "v1.35.4", "{version:?}");
    ensure!(
        namespaces.get_opt(&marker).await?.is_some(),
        "namespace {marker} did not survive the restart"
    );
    env.kubectl_ok(HUB, ["get", "namespace", marker.as_str()]).await?;
    // The aggregated Karmada API is back with the hub, and the members stayed Ready.
    let clusters: Api<DynamicObject> = Api::all_with(hub.clone(), &cluster_resource());
    ensure!(
        clusters.list(&Default::default()).await?.items.len() == Cluster::MEMBERS.len(),
        "the restarted hub does not serve the members' Clusters"
    );
    let status = env.status().await;
    ensure!(status.healthy(), "unhealthy after the restart: {status:#?}");

    // The hub's kube-controller-manager (namespace controller) finishes the deletion.
    namespaces.delete(&marker, &DeleteParams::default()).await?;
    wait::until_observed(
        DEADLINE,
        &format!("the hub's namespace controller to delete {marker}"),
        || async {
            Ok::<_, kube::Error>(match namespaces.get_opt(&marker).await? {
                None => Check::Ready(()),
                Some(ns) => Check::NotYet(format!("phase {:?}", ns.status.and_then(|status| status.phase))),
            })
        },
    )
    .await?;
    Ok(())
}
