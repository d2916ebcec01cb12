//! `replicator membership` deployed from `config/hub` as the product ships it (issue 15 §4):
//! two replicas in the hub's host cluster (cell-b here, as in the README scenario), one holding
//! hub Lease `replicator-system/replicator.membership`, a PodDisruptionBudget that lets a drain
//! evict one replica and refuses the second, and a NetworkService whose status keeps following
//! its members while the leader is evicted and the standby takes over.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::EvictParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};
use replicator::api::NetworkService;
use replicator_e2e::deploy::{self, Base, MEMBERSHIP_SECRET, MEMBERSHIP_SELECTOR, SYSTEM_NAMESPACE};
use replicator_e2e::images::Images;
use replicator_e2e::wait::{self, Check};
use replicator_e2e::{CELL_B, Environment, HUB, fixtures, fixtures::unique, metrics};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Pods of a fresh Deployment become Ready within this (image import, Secret mount, first lists).
const PODS_READY: Duration = Duration::from_secs(120);
/// A graceful stop (an eviction) releases the Lease; the standby, watching it, takes it within
/// a round trip. Bounded well below the Lease duration (15 s) that a killed leader would cost.
const HANDOVER: Duration = Duration::from_secs(5);
/// Status and slices follow a change on the hub within this.
const CONVERGE: Duration = Duration::from_secs(20);

/// Removes the membership Lease from the hub when dropped (after [`deploy::Teardown`], which is
/// declared later and so dropped first, has removed the pods that could take it again).
struct LeaseTeardown {
    kubectl: PathBuf,
    hub: PathBuf,
}

impl Drop for LeaseTeardown {
    fn drop(&mut self) {
        let status = std::process::Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.hub)
            .args([
                "-n",
                SYSTEM_NAMESPACE,
                "delete",
                "lease",
                replicator::membership::LEASE,
                "--ignore-not-found",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            eprintln!("teardown: deleting Lease {} failed", replicator::membership::LEASE);
        }
    }
}

/// An admin client of cell-b that reports a 429 instead of retrying it (kube retries 429, 503
/// and 504 by default): the budget's refusal is what the test looks at.
async fn client_without_retry(env: &Environment) -> Client {
    let kubeconfig = Kubeconfig::read_from(env.kubeconfig_path(CELL_B)).unwrap();
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    config.default_retry = false;
    Client::try_from(config).unwrap()
}

async fn holder(hub: &Client) -> Option<String> {
    Api::<Lease>::namespaced(hub.clone(), SYSTEM_NAMESPACE)
        .get_opt(replicator::membership::LEASE)
        .await
        .ok()
        .flatten()
        .and_then(|l| deploy::holder(&l))
        .map(|h| h.identity)
}

/// `replicator_membership_leader` of a deployed pod; a missing metric fails.
async fn leader_metric(pod: &Pod) -> f64 {
    let text = deploy::scrape_metrics(pod).await.unwrap();
    metrics::metric_value(&text, "replicator_membership_leader", &[])
        .unwrap_or_else(|| panic!("{}: replicator_membership_leader missing", pod.name_any()))
}

async fn status(hub: &Client, ns: &str) -> Value {
    Api::<NetworkService>::namespaced(hub.clone(), ns)
        .get_opt("web")
        .await
        .ok()
        .flatten()
        .map(|s| serde_json::to_value(s.status).unwrap())
        .unwrap_or(Value::Null)
}

/// Waits until the service counts `members` members, `healthy` of them healthy, and is Ready.
async fn wait_counts(hub: &Client, ns: &str, members: u64, healthy: u64, within: Duration) -> Value {
    let what = format!("web: {members} members, {healthy} healthy");
    wait::until_observed(within, &what, || async {
        let s = status(hub, ns).await;
        let ready = s["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .is_some_and(|c| c["status"] == "True");
        Ok::<_, String>(
            if s["summary"]["members"] == members && s["summary"]["healthy"] == healthy && ready {
                Check::Ready(s)
            } else {
                Check::NotYet(s.to_string())
            },
        )
    })
    .await
    .unwrap()
}

async fn wait_budget(cell: &Client, healthy: i32, allowed: i32) -> PodDisruptionBudget {
    let api = Api::<PodDisruptionBudget>::namespaced(cell.clone(), SYSTEM_NAMESPACE);
    let what = format!("PodDisruptionBudget: {healthy} healthy, {allowed} disruption allowed");
    wait::until_observed(PODS_READY, &what, || async {
        let pdb = api.get("replicator-membership").await?;
        let s = pdb.status.clone().unwrap_or_default();
        Ok::<_, kube::Error>(if s.current_healthy == healthy && s.disruptions_allowed == allowed {
            Check::Ready(pdb)
        } else {
            Check::NotYet(format!("{s:?}"))
        })
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn deployed_membership_elects_one_of_two_replicas_and_survives_an_eviction() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let image = Images::read(&Images::dir())?.replicator;
    deploy::require_free(&env, CELL_B).await?;
    let _lease = LeaseTeardown {
        kubectl: env.binaries().kubectl.clone(),
        hub: env.kubeconfig_path(HUB),
    };
    let mut teardown = deploy::Teardown::new(&env, &[]).await?;
    let hub = env.client(HUB).await?;
    let cell = env.client(CELL_B).await?;

    // The README's steps for membership: CRDs and RBAC on the hub, `config/hub` on the hub's
    // host, then the Secret it mounts.
    deploy::apply(&env, HUB, &deploy::config_dir("crds")).await?;
    deploy::apply_hub_rbac_for(&env, &mut teardown, &[]).await?;
    let overlay = deploy::write_overlay("membership-ha", Base::Membership, &image)?;
    teardown.path(&overlay);
    teardown.applied(CELL_B, &overlay);
    deploy::apply(&env, CELL_B, &overlay).await?;
    let kubeconfig = overlay.join("hub.kubeconfig");
    deploy::write_hub_kubeconfig(&env, deploy::MEMBERSHIP_SERVICE_ACCOUNT, &kubeconfig).await?;
    deploy::create_secret(&env, CELL_B, MEMBERSHIP_SECRET, &kubeconfig).await?;
    let started = Instant::now();
    let pods = deploy::wait_pods_ready(&cell, MEMBERSHIP_SELECTOR, 2, PODS_READY).await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    let leader = wait::until(PODS_READY, "a membership pod holds the Lease", || async {
        Ok::<_, String>(holder(&hub).await.filter(|h| names.contains(h)))
    })
    .await?;
    eprintln!(
        "2 pods Ready and {leader} leading {:.1}s after the Secret",
        started.elapsed().as_secs_f64()
    );
    for pod in &pods {
        let want = if pod.name_any() == leader { 1.0 } else { 0.0 };
        assert_eq!(leader_metric(pod).await, want, "{}", pod.name_any());
    }
    wait_budget(&cell, 2, 1).await;

    // A service on the hub, members written as copies straight onto the hub.
    let ns = unique("memha");
    teardown.namespace(HUB, &ns);
    deploy::routed_namespace(&env, &[HUB], &ns).await?;
    let ni = fixtures::resource("networkinterfaces")?;
    for i in 1..=3 {
        let name = format!("web-{i}");
        let mut obj = fixtures::network_interface(&ns, &name, "default", &name, "web", "dfw");
        obj["spec"]["addresses"] = json!([{"family": "IPv6", "address": format!("fd80::{i}/64"), "primary": true}]);
        fixtures::apply(&hub, &ni, &obj).await?;
        fixtures::set_status(&hub, &ni, &ns, &name, fixtures::bound_status(true)).await?;
    }
    fixtures::apply(
        &hub,
        &fixtures::network_service_resource(),
        &fixtures::network_service(&ns, "web", "web"),
    )
    .await?;
    wait_counts(&hub, &ns, 3, 3, CONVERGE).await;

    // A drain: the leader is evicted (allowed: one disruption), the second eviction is refused
    // by the budget while the first pod is away, and the standby takes the Lease at once.
    let pods_api = Api::<Pod>::namespaced(cell.clone(), SYSTEM_NAMESPACE);
    let evicted = Instant::now();
    pods_api.evict(&leader, &EvictParams::default()).await?;
    let standby = names.iter().find(|n| **n != leader).unwrap().clone();
    // Without kube's default retry of 429, which would wait for the budget to allow it.
    let no_retry = Api::<Pod>::namespaced(client_without_retry(&env).await, SYSTEM_NAMESPACE);
    match no_retry.evict(&standby, &EvictParams::default()).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 429, "the budget refuses: {s:?}"),
        other => panic!("evicting the second replica must be refused by the budget, got {other:?}"),
    }
    fixtures::set_status(&hub, &ni, &ns, "web-1", fixtures::bound_status(false)).await?;
    // The standby, or the replacement the ReplicaSet starts at once, whichever asks first.
    let taken = wait::until(HANDOVER * 2, "another replica takes the Lease", || async {
        Ok::<_, String>(holder(&hub).await.filter(|h| *h != leader))
    })
    .await?;
    let handover = evicted.elapsed();
    let which = if taken == standby {
        "the standby"
    } else {
        "the replacement pod"
    };
    eprintln!("{leader} evicted; {taken} ({which}) holds the Lease after {handover:?}");
    assert!(handover < HANDOVER, "handed over in {handover:?}");
    let s = wait_counts(&hub, &ns, 3, 2, CONVERGE).await;
    assert_eq!(
        s["locations"],
        json!([{"name": "dfw", "members": 3, "healthy": 2, "serving": true}])
    );

    // The ReplicaSet brings the second replica back; the budget allows one disruption again.
    let pods = deploy::wait_pods_ready(&cell, MEMBERSHIP_SELECTOR, 2, PODS_READY).await?;
    wait_budget(&cell, 2, 1).await;
    let now = holder(&hub).await;
    assert!(
        pods.iter().any(|p| Some(p.name_any()) == now),
        "the Lease is held by a live replica: {now:?}"
    );
    for pod in &pods {
        let want = if Some(pod.name_any()) == now { 1.0 } else { 0.0 };
        assert_eq!(leader_metric(pod).await, want, "{}", pod.name_any());
    }
    fixtures::set_status(&hub, &ni, &ns, "web-1", fixtures::bound_status(true)).await?;
    wait_counts(&hub, &ns, 3, 3, CONVERGE).await;
    teardown.finish(&env).await?;
    Ok(())
}
