//! NetworkService membership on the real control plane (issue 4, §1 and §3): CEL validation on a
//! real apiserver, and `replicator membership` resolving interfaces mirrored from two cells by
//! `replicator run`.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use k8s_openapi::api::{coordination::v1::Lease, discovery::v1::EndpointSlice, events::v1::Event};
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use replicator::api::NetworkService;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, CONVERGE, unique},
    rbac, wait,
};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

async fn start(spec: ReplicatorSpec, env: &Environment) -> ReplicatorProcess {
    let mut p = ReplicatorProcess::spawn(env, spec).await.unwrap();
    p.wait_ready(Duration::from_secs(60)).await.unwrap();
    p
}

/// Creates `n` Bound interfaces of `workload` in `cell` on `network`, with distinct addresses.
#[allow(clippy::too_many_arguments)] // a scenario helper: every argument is a knob the scenarios turn
async fn interfaces(
    env: &Environment,
    cell: Cluster,
    ns: &str,
    prefix: &str,
    workload: &str,
    location: &str,
    network: &str,
    n: usize,
    healthy: bool,
) -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let client = env.client(cell).await?;
    let ni = fixtures::resource("networkinterfaces")?;
    let mut names = Vec::new();
    for i in 0..n {
        let name = format!("{prefix}-{i}");
        let mut obj = fixtures::network_interface(ns, &name, network, &name, workload, location);
        obj["spec"]["addresses"] =
            json!([{"family": "IPv6", "address": format!("fd20:0:{:x}::{:x}/64", cell as u8, i + 1), "primary": true}]);
        fixtures::apply(&client, &ni, &obj).await?;
        fixtures::set_status(&client, &ni, ns, &name, fixtures::bound_status(healthy)).await?;
        names.push(name);
    }
    Ok(names)
}

async fn service_status(hub: &kube::Client, ns: &str, name: &str) -> Value {
    let api = Api::<NetworkService>::namespaced(hub.clone(), ns);
    api.get_opt(name)
        .await
        .ok()
        .flatten()
        .map(|s| serde_json::to_value(s.status).unwrap())
        .unwrap_or(Value::Null)
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

async fn wait_status(hub: &kube::Client, ns: &str, name: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    wait::until_observed(CONVERGE, what, || async {
        let s = service_status(hub, ns, name).await;
        Ok::<_, String>(if check(&s) {
            wait::Check::Ready(s)
        } else {
            wait::Check::NotYet(s.to_string())
        })
    })
    .await
    .unwrap()
}

async fn slices(hub: &kube::Client, ns: &str, service: &str) -> Vec<EndpointSlice> {
    let api = Api::<EndpointSlice>::namespaced(hub.clone(), ns);
    let mut items = api
        .list(&ListParams::default().labels(&format!("networking.datumapis.com/network-service={service}")))
        .await
        .unwrap()
        .items;
    items.sort_by_key(|s| s.name_any());
    items
}

#[tokio::test]
async fn the_apiserver_rejects_invalid_network_services_with_clear_messages() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("cel");
    let _teardown = Teardown::new(&env, &[HUB], &ns, &[]);
    routed(&env, &[HUB], &ns).await?;
    let api = Api::<DynamicObject>::namespaced_with(env.client(HUB).await?, &ns, &fixtures::network_service_resource());
    let create = |body: Value| {
        let api = api.clone();
        async move {
            let obj: DynamicObject = serde_json::from_value(body).unwrap();
            api.create(&PostParams::default(), &obj).await
        }
    };
    let valid = fixtures::network_service(&ns, "valid", "web");
    let created = create(valid.clone()).await?;
    let v = serde_json::to_value(&created)?;
    assert_eq!(v["spec"]["ports"][0]["protocol"], "TCP", "protocol defaults to TCP");

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "empty-selector",
            json!({"networkInterfaces": {"selector": {}}, "ports": [{"name": "http", "port": 80}]}),
            "selector must set matchLabels or matchExpressions",
        ),
        (
            "empty-labels",
            json!({"networkInterfaces": {"selector": {"matchLabels": {}}}, "ports": [{"name": "http", "port": 80}]}),
            "selector must set matchLabels or matchExpressions",
        ),
        (
            "dup-names",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}},
            "ports": [{"name": "http", "port": 80}, {"name": "http", "port": 81}]}),
            "port names must be unique",
        ),
        (
            "dup-numbers",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}},
            "ports": [{"name": "http", "port": 80}, {"name": "alt", "port": 80}]}),
            "port numbers must be unique",
        ),
        (
            "udp",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}},
            "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
            "Unsupported value: \"UDP\"",
        ),
        (
            "no-ports",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}}, "ports": []}),
            "should have at least 1 items",
        ),
        (
            "app-protocol",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}},
            "ports": [{"name": "http", "port": 80, "appProtocol": "not a protocol"}]}),
            "spec.ports[0].appProtocol",
        ),
        (
            "strategy",
            json!({"networkInterfaces": {"selector": {"matchLabels": {"a": "b"}}},
            "ports": [{"name": "http", "port": 80}], "trafficDistribution": {"strategy": "Random"}}),
            "Unsupported value: \"Random\"",
        ),
    ];
    for (name, spec, message) in cases {
        let mut body = valid.clone();
        body["metadata"]["name"] = json!(name);
        body["spec"] = spec;
        match create(body).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 422, "{name}: {s:?}");
                assert!(
                    s.message.contains(message),
                    "{name}: expected {message:?} in {:?}",
                    s.message
                );
            }
            other => panic!("{name}: expected a 422 rejection, got {other:?}"),
        }
    }
    // A name with a dot (valid for most objects) would let slice names meet: rejected.
    let mut dotted = valid.clone();
    dotted["metadata"]["name"] = json!("web.v2");
    match create(dotted).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            assert!(
                s.message.contains("a NetworkService name must be a DNS label"),
                "{:?}",
                s.message
            );
        }
        other => panic!("web.v2: expected a 422 rejection, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn membership_follows_interfaces_mirrored_from_two_cells() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, workload, loc_a, loc_b) = (unique("svc"), unique("wl"), unique("dfw"), unique("sjc"));
    let leases = [format!("replicator-{loc_a}"), format!("replicator-{loc_b}")];
    let _teardown = Teardown::new(&env, &[HUB, CELL_A, CELL_B], &ns, &[&leases[0], &leases[1]]);
    routed(&env, &[HUB, CELL_A, CELL_B], &ns).await?;
    let hub = env.client(HUB).await?;
    let _ra = start(ReplicatorSpec::new(CELL_A).location(&loc_a), &env).await;
    let _rb = start(ReplicatorSpec::new(CELL_B).location(&loc_b), &env).await;
    let m = start(ReplicatorSpec::membership(), &env).await;

    interfaces(&env, CELL_A, &ns, "a", &workload, &loc_a, "default", 2, true).await?;
    interfaces(&env, CELL_B, &ns, "b", &workload, &loc_b, "default", 1, true).await?;
    fixtures::apply(
        &hub,
        &fixtures::network_service_resource(),
        &fixtures::network_service(&ns, "api", &workload),
    )
    .await?;

    let s = wait_status(&hub, &ns, "api", "3 members across 2 serving locations", |s| {
        s["summary"]["members"] == 3 && s["summary"]["healthy"] == 3
    })
    .await;
    assert_eq!(s["summary"]["locations"], 2);
    let mut expected = vec![
        json!({"name": loc_a, "members": 2, "healthy": 2, "serving": true}),
        json!({"name": loc_b, "members": 1, "healthy": 1, "serving": true}),
    ];
    expected.sort_by_key(|l| l["name"].as_str().unwrap().to_owned());
    assert_eq!(s["locations"], json!(expected));
    assert_eq!(condition(&s, "Ready")["status"], "True");
    assert_eq!(condition(&s, "MembersResolved")["reason"], "Resolved");
    let sl = slices(&hub, &ns, "api").await;
    assert_eq!(sl.len(), 1);
    assert_eq!(sl[0].name_any(), "api-http");
    assert_eq!(sl[0].endpoints.len(), 3);
    assert!(
        sl[0]
            .endpoints
            .iter()
            .all(|e| e.conditions.as_ref().unwrap().ready == Some(true))
    );
    assert_eq!(
        sl[0]
            .labels()
            .get("meta.datumapis.com/upstream-cluster-name")
            .map(String::as_str),
        Some(fixtures::UPSTREAM_CLUSTER)
    );
    let members = m
        .metric(
            "replicator_membership_members",
            &[("namespace", &ns), ("service", "api")],
        )
        .await?;
    assert_eq!(members, Some(3.0));

    // HolderAvailable flips in cell-b: its location stops serving, its endpoint goes unready.
    let ni = fixtures::resource("networkinterfaces")?;
    fixtures::set_status(
        &env.client(CELL_B).await?,
        &ni,
        &ns,
        "b-0",
        fixtures::bound_status(false),
    )
    .await?;
    let s = wait_status(&hub, &ns, "api", "cell-b unhealthy", |s| s["summary"]["healthy"] == 2).await;
    let b = s["locations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == loc_b.as_str())
        .unwrap();
    assert_eq!(b["serving"], false);
    wait::until(CONVERGE, "cell-b endpoint not ready", || async {
        let sl = slices(&hub, &ns, "api").await;
        let e = sl[0]
            .endpoints
            .iter()
            .find(|e| e.zone.as_deref() == Some(loc_b.as_str()))
            .cloned();
        Ok::<_, String>(e.filter(|e| {
            e.conditions.as_ref().unwrap().ready == Some(false) && e.conditions.as_ref().unwrap().serving == Some(false)
        }))
    })
    .await?;

    // Every member unhealthy: not serving anywhere, Ready False.
    let cell_a = env.client(CELL_A).await?;
    for name in ["a-0", "a-1"] {
        fixtures::set_status(&cell_a, &ni, &ns, name, fixtures::bound_status(false)).await?;
    }
    let s = wait_status(&hub, &ns, "api", "Ready False NoServingLocations", |s| {
        condition(s, "Ready")["reason"] == "NoServingLocations"
    })
    .await;
    assert_eq!(condition(&s, "Ready")["status"], "False");
    fixtures::set_status(&cell_a, &ni, &ns, "a-0", fixtures::bound_status(true)).await?;
    wait_status(&hub, &ns, "api", "Ready True again", |s| {
        condition(s, "Ready")["status"] == "True"
    })
    .await;

    // Leaving Bound stops counting; a dropped compute label removes the member.
    let mut available = fixtures::bound_status(true);
    available["phase"] = json!("Available");
    fixtures::set_status(&cell_a, &ni, &ns, "a-1", available).await?;
    wait_status(&hub, &ns, "api", "a-1 no longer a member", |s| {
        s["summary"]["members"] == 2
    })
    .await;
    let mut unlabelled = fixtures::network_interface(&ns, "b-0", "default", "b-0", &workload, &loc_b);
    unlabelled["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("compute.datumapis.com/workload");
    unlabelled["spec"]["addresses"] = json!([{"family": "IPv6", "address": "fd20:0:2::1/64", "primary": true}]);
    fixtures::apply(&env.client(CELL_B).await?, &ni, &unlabelled).await?;
    let s = wait_status(&hub, &ns, "api", "b-0 removed by its dropped label", |s| {
        s["summary"]["members"] == 1
    })
    .await;
    assert_eq!(s["summary"]["locations"], 1);
    wait::until(CONVERGE, "one endpoint left", || async {
        Ok::<_, String>((slices(&hub, &ns, "api").await[0].endpoints.len() == 1).then_some(()))
    })
    .await?;

    // Deleting the service removes its slices (owner references, hub garbage collector).
    fixtures::delete(&hub, &fixtures::network_service_resource(), &ns, "api").await?;
    wait::until(Duration::from_secs(60), "slices garbage-collected", || async {
        Ok::<_, String>(slices(&hub, &ns, "api").await.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn shards_families_and_multiple_networks() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("shard"), unique("dfw"));
    let lease = format!("replicator-{loc}");
    let _teardown = Teardown::new(&env, &[HUB, CELL_A], &ns, &[&lease]);
    routed(&env, &[HUB, CELL_A], &ns).await?;
    let hub = env.client(HUB).await?;
    let _r = start(
        ReplicatorSpec::new(CELL_A).location(&loc).args(["--workers", "8"]),
        &env,
    )
    .await;
    let _m = start(ReplicatorSpec::membership(), &env).await;
    let svc = fixtures::network_service_resource();

    // 250 members: three shards of 100, 100 and 50.
    let big = unique("big");
    interfaces(&env, CELL_A, &ns, "big", &big, &loc, "default", 250, true).await?;
    fixtures::apply(&hub, &svc, &fixtures::network_service(&ns, "big", &big)).await?;
    wait_status(&hub, &ns, "big", "250 members", |s| s["summary"]["members"] == 250).await;
    let shape = wait::until(Duration::from_secs(60), "three shards", || async {
        let sl = slices(&hub, &ns, "big").await;
        let shape: Vec<(String, usize)> = sl.iter().map(|s| (s.name_any(), s.endpoints.len())).collect();
        Ok::<_, String>((shape.iter().map(|(_, n)| n).sum::<usize>() == 250).then_some(shape))
    })
    .await?;
    assert_eq!(
        shape,
        vec![
            ("big-http".into(), 100),
            ("big.http.ipv6-1".into(), 100),
            ("big.http.ipv6-2".into(), 50)
        ]
    );

    // Dual-stack members: one IPv6 and one IPv4 slice set.
    let dual = unique("dual");
    let cell = env.client(CELL_A).await?;
    let ni = fixtures::resource("networkinterfaces")?;
    for i in 0..2 {
        let name = format!("dual-{i}");
        let mut obj = fixtures::network_interface(&ns, &name, "default", &name, &dual, &loc);
        obj["spec"]["addresses"] = json!([
            {"family": "IPv6", "address": format!("FD30:0:0:0::{}/64", i + 1), "primary": true},
            {"family": "IPv4", "address": format!("10.30.0.{}/24", i + 1), "primary": true}
        ]);
        fixtures::apply(&cell, &ni, &obj).await?;
        fixtures::set_status(&cell, &ni, &ns, &name, fixtures::bound_status(true)).await?;
    }
    fixtures::apply(&hub, &svc, &fixtures::network_service(&ns, "dual", &dual)).await?;
    let families = wait::until(CONVERGE, "IPv4 and IPv6 slices", || async {
        let sl = slices(&hub, &ns, "dual").await;
        let f: Vec<(String, String, Vec<String>)> = sl
            .iter()
            .map(|s| {
                (
                    s.name_any(),
                    s.address_type.clone(),
                    s.endpoints.iter().flat_map(|e| e.addresses.clone()).collect(),
                )
            })
            .collect();
        Ok::<_, String>((f.len() == 2 && f.iter().all(|(_, _, a)| a.len() == 2)).then_some(f))
    })
    .await?;
    assert_eq!(
        families,
        vec![
            (
                "dual-http".into(),
                "IPv6".into(),
                vec!["fd30::1".into(), "fd30::2".into()]
            ),
            (
                "dual.http.ipv4".into(),
                "IPv4".into(),
                vec!["10.30.0.1".into(), "10.30.0.2".into()]
            ),
        ],
        "internal addresses only, canonical text"
    );

    // Members on two networks: MultipleNetworks naming both.
    let split = unique("split");
    interfaces(&env, CELL_A, &ns, "blue", &split, &loc, "blue", 1, true).await?;
    interfaces(&env, CELL_A, &ns, "green", &split, &loc, "green", 1, true).await?;
    fixtures::apply(&hub, &svc, &fixtures::network_service(&ns, "split", &split)).await?;
    let s = wait_status(&hub, &ns, "split", "MultipleNetworks", |s| {
        condition(s, "MembersResolved")["reason"] == "MultipleNetworks"
    })
    .await;
    assert_eq!(
        condition(&s, "MembersResolved")["message"],
        "members span more than one network: blue, green"
    );
    assert_eq!(condition(&s, "Ready")["status"], "False");

    // Idempotence on a real apiserver: a pass that changes nothing writes no status.
    let api = Api::<NetworkService>::namespaced(hub.clone(), &ns);
    let metric = |name: &'static str| {
        let m = &_m;
        async move { m.counter(name, &[]).await.unwrap() }
    };
    let (passes, writes) = (
        metric("replicator_membership_passes_total").await,
        metric("replicator_membership_status_writes_total").await,
    );
    api.patch(
        "split",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"touch": "1"}}})),
    )
    .await?;
    let touched = api.get("split").await?.resource_version();
    wait::until(CONVERGE, "a pass over the touched service", || async {
        Ok::<_, String>((metric("replicator_membership_passes_total").await > passes).then_some(()))
    })
    .await?;
    assert_eq!(
        metric("replicator_membership_status_writes_total").await,
        writes,
        "no status write when nothing changed"
    );
    assert_eq!(api.get("split").await?.resource_version(), touched);
    // Every later scenario's replicator mirrors all of cell-a: take the 250 members away again.
    env.kubectl_ok(
        CELL_A,
        [
            "-n",
            ns.as_str(),
            "delete",
            "networkinterfaces.networking.datumapis.com",
            "--all",
            "--wait=false",
        ],
    )
    .await?;
    Ok(())
}

/// Removes what a scenario made, even when an assertion fails: its namespace in each cluster it
/// was made in (their namespace controllers delete the services, interfaces and slices in it)
/// and the hub Leases its processes elected on. Processes are killed by their own drop.
struct Teardown {
    kubectl: PathBuf,
    kubeconfigs: Vec<PathBuf>,
    hub: PathBuf,
    namespace: String,
    leases: Vec<String>,
}

impl Teardown {
    /// Removes `namespace` from each of `clusters` (made there by [`routed`], never propagated
    /// by Karmada) and `leases` from the harness's Lease namespace on the hub.
    fn new(env: &Environment, clusters: &[Cluster], namespace: &str, leases: &[&str]) -> Teardown {
        Teardown {
            kubectl: env.binaries().kubectl.clone(),
            kubeconfigs: clusters.iter().map(|c| env.kubeconfig_path(*c)).collect(),
            hub: env.kubeconfig_path(HUB),
            namespace: namespace.to_owned(),
            leases: leases.iter().map(|l| (*l).to_owned()).collect(),
        }
    }

    fn kubectl(&self, kubeconfig: &PathBuf, args: &[&str]) {
        let status = std::process::Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            eprintln!("teardown: kubectl {} failed", args.join(" "));
        }
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        for kubeconfig in &self.kubeconfigs {
            self.kubectl(
                kubeconfig,
                &[
                    "delete",
                    "namespace",
                    &self.namespace,
                    "--ignore-not-found",
                    "--wait=false",
                ],
            );
        }
        for lease in &self.leases {
            self.kubectl(
                &self.hub,
                &["-n", rbac::NAMESPACE, "delete", "lease", lease, "--ignore-not-found"],
            );
        }
    }
}

/// Creates namespace `ns` in `clusters` with the project-routing labels, kept from Karmada's
/// namespace propagation (edge-1 has no namespace controller to remove a propagated one again).
async fn routed(env: &Environment, clusters: &[Cluster], ns: &str) -> TestResult {
    fixtures::namespace_routed_to(env, clusters, ns, fixtures::UPSTREAM_CLUSTER, "default").await?;
    Ok(())
}

/// Writes a Bound NetworkInterface copy straight onto the hub (what `replicator run` would
/// publish): location `loc`, selected by `workload`, with `addresses` (the spec's list).
async fn hub_interface(
    hub: &kube::Client,
    ns: &str,
    name: &str,
    workload: &str,
    loc: &str,
    addresses: Value,
    healthy: bool,
) -> TestResult {
    let ni = fixtures::resource("networkinterfaces")?;
    let mut obj = fixtures::network_interface(ns, name, "default", name, workload, loc);
    obj["spec"]["addresses"] = addresses;
    fixtures::apply(hub, &ni, &obj).await?;
    fixtures::set_status(hub, &ni, ns, name, fixtures::bound_status(healthy)).await?;
    Ok(())
}

fn v6(address: &str) -> Value {
    json!([{"family": "IPv6", "address": address, "primary": true}])
}

fn v4(address: &str) -> Value {
    json!([{"family": "IPv4", "address": address, "primary": true}])
}

fn dual(v6: &str, v4: &str) -> Value {
    json!([{"family": "IPv6", "address": v6, "primary": true}, {"family": "IPv4", "address": v4, "primary": true}])
}

/// A service on `workload` with `ports` (the spec's list, as JSON).
fn service_with_ports(ns: &str, name: &str, workload: &str, ports: Value) -> Value {
    let mut body = fixtures::network_service(ns, name, workload);
    body["spec"]["ports"] = ports;
    body
}

/// One slice as the test looks at it: name, address type, addresses (sorted), appProtocol of
/// its port, its `kubernetes.io/service-name`.
type SliceView = (String, String, Vec<String>, String, String);

fn view(s: &EndpointSlice) -> SliceView {
    let mut addresses: Vec<String> = s.endpoints.iter().flat_map(|e| e.addresses.clone()).collect();
    addresses.sort();
    (
        s.name_any(),
        s.address_type.clone(),
        addresses,
        s.ports
            .as_ref()
            .and_then(|p| p.first())
            .and_then(|p| p.app_protocol.clone())
            .unwrap_or_default(),
        s.labels()
            .get("kubernetes.io/service-name")
            .cloned()
            .unwrap_or_default(),
    )
}

fn sv(name: &str, family: &str, addresses: &[&str], app: &str, base: &str) -> SliceView {
    (
        name.into(),
        family.into(),
        addresses.iter().map(|a| (*a).to_owned()).collect(),
        app.into(),
        base.into(),
    )
}

/// Waits until the slices of `service` look exactly like `want` (sorted by name).
async fn wait_slices(hub: &kube::Client, ns: &str, service: &str, want: Vec<SliceView>) {
    let what = format!("slices of {service}");
    wait::until_observed(CONVERGE, &what, || async {
        let got: Vec<SliceView> = slices(hub, ns, service).await.iter().map(view).collect();
        Ok::<_, String>(if got == want {
            wait::Check::Ready(())
        } else {
            wait::Check::NotYet(format!("{got:?}"))
        })
    })
    .await
    .unwrap();
}

async fn slice_named(hub: &kube::Client, ns: &str, name: &str) -> Option<EndpointSlice> {
    Api::<EndpointSlice>::namespaced(hub.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

/// Events on NetworkService `service` with `reason`, as `note`s.
async fn events(hub: &kube::Client, ns: &str, service: &str, reason: &str) -> Vec<String> {
    Api::<Event>::namespaced(hub.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(service) && e.reason.as_deref() == Some(reason)
        })
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test]
async fn slices_always_resolve_never_collide_and_never_overwrite() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("slices");
    let _teardown = Teardown::new(&env, &[HUB], &ns, &[]);
    routed(&env, &[HUB], &ns).await?;
    let hub = env.client(HUB).await?;
    let m = start(ReplicatorSpec::membership(), &env).await;
    let svc = fixtures::network_service_resource();
    let loc = "dfw";

    // IPv4-only members: the IPv6 slice a gateway's backendRef names exists, empty; the IPv4
    // slice holds the members. appProtocol defaults to http and is carried per port.
    for i in 1..=2 {
        hub_interface(
            &hub,
            &ns,
            &format!("four-{i}"),
            "four",
            loc,
            v4(&format!("10.40.0.{i}/24")),
            true,
        )
        .await?;
    }
    fixtures::apply(
        &hub,
        &svc,
        &service_with_ports(
            &ns,
            "four",
            "four",
            json!([{"name": "http", "port": 8080}, {"name": "grpc", "port": 9090, "appProtocol": "kubernetes.io/h2c"}]),
        ),
    )
    .await?;
    let stored = Api::<NetworkService>::namespaced(hub.clone(), &ns).get("four").await?;
    assert_eq!(
        stored.spec.ports[0].app_protocol.as_deref(),
        Some("http"),
        "the CRD defaults it"
    );
    let four_v4 = ["10.40.0.1", "10.40.0.2"];
    wait_slices(
        &hub,
        &ns,
        "four",
        vec![
            sv("four-grpc", "IPv6", &[], "kubernetes.io/h2c", "four-grpc"),
            sv("four-http", "IPv6", &[], "http", "four-http"),
            sv("four.grpc.ipv4", "IPv4", &four_v4, "kubernetes.io/h2c", "four-grpc"),
            sv("four.http.ipv4", "IPv4", &four_v4, "http", "four-http"),
        ],
    )
    .await;
    let s = wait_status(&hub, &ns, "four", "four Ready, slices published", |s| {
        condition(s, "Ready")["status"] == "True" && condition(s, "SlicesPublished")["status"] == "True"
    })
    .await;
    assert_eq!(s["summary"]["members"], 2);

    // Ports whose names collided under the old scheme (`http-ipv4` with the IPv4 set of `http`;
    // `http-1` with shard 1 of `http`): every port gets its own slices. 101 members make a
    // second shard.
    for i in 0..101 {
        let addresses = if i < 2 {
            dual(&format!("fd50::{:x}/64", i + 1), &format!("10.50.0.{}/24", i + 1))
        } else {
            v6(&format!("fd50::{:x}/64", i + 1))
        };
        hub_interface(&hub, &ns, &format!("p-{i:03}"), "p", loc, addresses, true).await?;
    }
    fixtures::apply(
        &hub,
        &svc,
        &service_with_ports(
            &ns,
            "p",
            "p",
            json!([
                {"name": "http", "port": 80},
                {"name": "http-ipv4", "port": 81},
                {"name": "http-1", "port": 82}
            ]),
        ),
    )
    .await?;
    let got = wait::until_observed(CONVERGE, "slices of p", || async {
        let got: Vec<(String, String, usize, String)> = slices(&hub, &ns, "p")
            .await
            .iter()
            .map(|s| {
                let (name, family, addresses, _, base) = view(s);
                (name, family, addresses.len(), base)
            })
            .collect();
        Ok::<_, String>(
            if got.len() == 9 && got.iter().filter(|s| s.1 == "IPv6").map(|s| s.2).sum::<usize>() == 303 {
                wait::Check::Ready(got)
            } else {
                wait::Check::NotYet(format!("{got:?}"))
            },
        )
    })
    .await?;
    let row = |n: &str, f: &str, c: usize, b: &str| (n.to_owned(), f.to_owned(), c, b.to_owned());
    assert_eq!(
        got,
        vec![
            row("p-http", "IPv6", 100, "p-http"),
            row("p-http-1", "IPv6", 100, "p-http-1"),
            row("p-http-ipv4", "IPv6", 100, "p-http-ipv4"),
            row("p.http-1.ipv4", "IPv4", 2, "p-http-1"),
            row("p.http-1.ipv6-1", "IPv6", 1, "p-http-1"),
            row("p.http-ipv4.ipv4", "IPv4", 2, "p-http-ipv4"),
            row("p.http-ipv4.ipv6-1", "IPv6", 1, "p-http-ipv4"),
            row("p.http.ipv4", "IPv4", 2, "p-http"),
            row("p.http.ipv6-1", "IPv6", 1, "p-http"),
        ]
    );
    wait_status(&hub, &ns, "p", "p Ready, slices published", |s| {
        s["summary"]["members"] == 101 && condition(s, "SlicesPublished")["reason"] == "Published"
    })
    .await;

    // Service `a` port `b-c` and service `a-b` port `c` both want `a-b-c`, the one name a
    // gateway resolves: the first keeps it, the second is told and never overwrites it.
    for i in 1..=2 {
        hub_interface(
            &hub,
            &ns,
            &format!("ab-{i}"),
            "ab",
            loc,
            dual(&format!("fd60::{i}/64"), &format!("10.60.0.{i}/24")),
            true,
        )
        .await?;
    }
    fixtures::apply(
        &hub,
        &svc,
        &service_with_ports(&ns, "a", "ab", json!([{"name": "b-c", "port": 80}])),
    )
    .await?;
    wait_slices(
        &hub,
        &ns,
        "a",
        vec![
            sv("a-b-c", "IPv6", &["fd60::1", "fd60::2"], "http", "a-b-c"),
            sv("a.b-c.ipv4", "IPv4", &["10.60.0.1", "10.60.0.2"], "http", "a-b-c"),
        ],
    )
    .await;
    let a_uid = Api::<NetworkService>::namespaced(hub.clone(), &ns)
        .get("a")
        .await?
        .uid()
        .unwrap();
    let taken = slice_named(&hub, &ns, "a-b-c").await.unwrap();
    fixtures::apply(
        &hub,
        &svc,
        &service_with_ports(&ns, "a-b", "ab", json!([{"name": "c", "port": 80}])),
    )
    .await?;
    let s = wait_status(&hub, &ns, "a-b", "a-b reports the taken name", |s| {
        condition(s, "SlicesPublished")["reason"] == "SliceNameConflict"
    })
    .await;
    assert_eq!(s["summary"]["members"], 2, "the rest of the status still converges");
    assert_eq!(condition(&s, "MembersResolved")["status"], "True");
    assert_eq!(condition(&s, "Ready")["status"], "False");
    assert_eq!(condition(&s, "Ready")["reason"], "SliceNameConflict");
    assert_eq!(
        condition(&s, "SlicesPublished")["message"],
        "not overwritten: EndpointSlice a-b-c belongs to NetworkService a"
    );
    // Its other slices are its own; `a-b-c` stays `a`'s, untouched.
    let own = slice_named(&hub, &ns, "a-b.c.ipv4").await.expect("a-b.c.ipv4");
    assert_eq!(own.owner_references()[0].name, "a-b");
    let still = slice_named(&hub, &ns, "a-b-c").await.unwrap();
    assert_eq!(
        still.resource_version(),
        taken.resource_version(),
        "never written by a-b"
    );
    assert_eq!(still.owner_references()[0].uid, a_uid);
    let a = wait_status(&hub, &ns, "a", "a Ready", |s| condition(s, "Ready")["status"] == "True").await;
    assert_eq!(condition(&a, "SlicesPublished")["reason"], "Published");
    let conflicts = m
        .metric(
            "replicator_membership_slice_conflicts",
            &[("namespace", &ns), ("service", "a-b")],
        )
        .await?;
    assert_eq!(conflicts, Some(1.0));
    wait::until(CONVERGE, "a SliceNameConflict Event on a-b", || async {
        let notes = events(&hub, &ns, "a-b", "SliceNameConflict").await;
        Ok::<_, String>(
            notes
                .into_iter()
                .find(|n| n.contains("EndpointSlice a-b-c belongs to NetworkService a")),
        )
    })
    .await?;
    // No fight: another pass over `a-b` (a touched annotation) leaves `a-b-c` as it was.
    let passes = m.metric("replicator_membership_passes_total", &[]).await?.unwrap();
    Api::<NetworkService>::namespaced(hub.clone(), &ns)
        .patch(
            "a-b",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"touch": "1"}}})),
        )
        .await?;
    wait::until(CONVERGE, "a pass over the touched a-b", || async {
        let now = m
            .metric("replicator_membership_passes_total", &[])
            .await
            .unwrap()
            .unwrap();
        Ok::<_, String>((now > passes).then_some(()))
    })
    .await?;
    let after = slice_named(&hub, &ns, "a-b-c").await.unwrap();
    assert_eq!(after.resource_version(), taken.resource_version());

    // A hand-made slice (not this controller's, another address type) under a desired name is
    // left as it is and reported; once it goes, the service's own slice takes the name.
    let handmade: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "h-http", "namespace": ns},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["192.0.2.1"]}],
        "ports": [{"name": "web", "port": 8000, "protocol": "TCP"}]
    }))?;
    let slices_api = Api::<EndpointSlice>::namespaced(hub.clone(), &ns);
    let handmade = slices_api.create(&PostParams::default(), &handmade).await?;
    fixtures::apply(
        &hub,
        &svc,
        &service_with_ports(&ns, "h", "ab", json!([{"name": "http", "port": 80}])),
    )
    .await?;
    let s = wait_status(&hub, &ns, "h", "h reports the hand-made slice", |s| {
        condition(s, "SlicesPublished")["reason"] == "SliceNameConflict"
    })
    .await;
    assert_eq!(
        condition(&s, "SlicesPublished")["message"],
        "not overwritten: EndpointSlice h-http exists and is not managed by this controller"
    );
    assert_eq!(s["summary"]["members"], 2);
    let kept = slice_named(&hub, &ns, "h-http").await.unwrap();
    assert_eq!(kept.resource_version(), handmade.resource_version(), "untouched");
    assert_eq!(view(&kept), sv("h-http", "IPv4", &["192.0.2.1"], "", ""));
    assert!(
        slice_named(&hub, &ns, "h.http.ipv4").await.is_some(),
        "the IPv4 slice is published"
    );
    assert_eq!(
        m.metric(
            "replicator_membership_slice_conflicts",
            &[("namespace", &ns), ("service", "h")]
        )
        .await?,
        Some(1.0)
    );
    wait::until(CONVERGE, "a SliceNameConflict Event on h", || async {
        let notes = events(&hub, &ns, "h", "SliceNameConflict").await;
        Ok::<_, String>(notes.into_iter().find(|n| n.contains("h-http")))
    })
    .await?;
    slices_api.delete("h-http", &Default::default()).await?;
    // The hand-made slice carries none of the watched labels: the service is looked at again
    // within a minute (the controller's recheck of a taken name).
    let s = wait::until_observed(Duration::from_secs(90), "h publishes h-http", || async {
        let s = service_status(&hub, &ns, "h").await;
        let slice = slice_named(&hub, &ns, "h-http").await.map(|s| view(&s));
        Ok::<_, String>(
            if condition(&s, "SlicesPublished")["reason"] == "Published"
                && slice == Some(sv("h-http", "IPv6", &["fd60::1", "fd60::2"], "http", "h-http"))
            {
                wait::Check::Ready(s)
            } else {
                wait::Check::NotYet(format!("{slice:?} {s}"))
            },
        )
    })
    .await?;
    assert_eq!(condition(&s, "Ready")["status"], "True");
    assert_eq!(
        m.metric(
            "replicator_membership_slice_conflicts",
            &[("namespace", &ns), ("service", "h")]
        )
        .await?,
        Some(0.0)
    );
    Ok(())
}

/// What the test expects of the churned service: interface name to whether it is healthy.
type Model = BTreeMap<String, bool>;

/// The address of churned interface `name` (`c-<n>`).
fn churn_address(name: &str) -> String {
    let n: u32 = name.trim_start_matches("c-").parse().unwrap();
    format!("fd70::{:x}", n + 1)
}

/// Applies one churn step `step` to the hub and to `model`: add an interface, flip one's
/// health, or delete one, in turn.
async fn churn(hub: &kube::Client, ns: &str, loc: &str, model: &mut Model, next: &mut u32, step: usize) -> TestResult {
    let ni = fixtures::resource("networkinterfaces")?;
    match step % 3 {
        0 => {
            let name = format!("c-{next}");
            *next += 1;
            let address = format!("{}/64", churn_address(&name));
            hub_interface(hub, ns, &name, "churn", loc, v6(&address), true).await?;
            model.insert(name, true);
        }
        1 => {
            let (name, healthy) = model.iter().next().map(|(n, h)| (n.clone(), *h)).unwrap();
            fixtures::set_status(hub, &ni, ns, &name, fixtures::bound_status(!healthy)).await?;
            model.insert(name, !healthy);
        }
        _ => {
            let name = model.keys().next_back().cloned().unwrap();
            fixtures::delete(hub, &ni, ns, &name).await?;
            model.remove(&name);
        }
    }
    Ok(())
}

/// Waits until the service status and its slice are what `model` says: member and healthy
/// counts, the one location, and exactly the model's addresses with their readiness.
async fn wait_model(hub: &kube::Client, ns: &str, loc: &str, model: &Model, deadline: Duration) {
    let members = model.len();
    let healthy = model.values().filter(|h| **h).count();
    let want_location = json!([{"name": loc, "members": members, "healthy": healthy, "serving": healthy > 0}]);
    let mut want_endpoints: Vec<(String, bool)> = model.iter().map(|(n, h)| (churn_address(n), *h)).collect();
    want_endpoints.sort();
    wait::until_observed(deadline, "the status and slice follow the churn", || async {
        let s = service_status(hub, ns, "churn").await;
        let mut endpoints: Vec<(String, bool)> = slice_named(hub, ns, "churn-http")
            .await
            .map(|s| {
                s.endpoints
                    .iter()
                    .map(|e| {
                        (
                            e.addresses[0].clone(),
                            e.conditions.as_ref().unwrap().ready == Some(true),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        endpoints.sort();
        Ok::<_, String>(
            if s["summary"]["members"] == members
                && s["summary"]["healthy"] == healthy
                && s["locations"] == want_location
                && endpoints == want_endpoints
            {
                wait::Check::Ready(())
            } else {
                wait::Check::NotYet(format!("status {s}, endpoints {endpoints:?}"))
            },
        )
    })
    .await
    .unwrap();
}

async fn lease_holder(hub: &kube::Client, lease: &str) -> Option<String> {
    Api::<Lease>::namespaced(hub.clone(), rbac::NAMESPACE)
        .get_opt(lease)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
}

async fn leading(p: &ReplicatorProcess) -> Option<f64> {
    p.metric("replicator_membership_leader", &[]).await.ok().flatten()
}

#[tokio::test]
async fn a_killed_membership_leader_is_replaced_and_the_status_keeps_converging() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("elect");
    let lease = unique("e2e-membership");
    let _teardown = Teardown::new(&env, &[HUB], &ns, &[&lease]);
    routed(&env, &[HUB], &ns).await?;
    let hub = env.client(HUB).await?;
    let loc = "dfw";
    let duration = Duration::from_secs(4);
    let spec = || {
        ReplicatorSpec::membership().args([
            "--lease-name",
            lease.as_str(),
            "--lease-duration",
            "4s",
            "--lease-grace",
            "2s",
        ])
    };
    let first = start(spec(), &env).await;
    let holder = wait::until(CONVERGE, "the first replica leads", || async {
        Ok::<_, String>(lease_holder(&hub, &lease).await.filter(|h| h == first.identity()))
    })
    .await?;
    let second = start(spec(), &env).await;
    assert_eq!(leading(&first).await, Some(1.0));
    assert_eq!(leading(&second).await, Some(0.0), "the second stands by");
    assert_eq!(holder, first.identity());

    let mut model = Model::new();
    let mut next = 0;
    for step in 0..6 {
        churn(&hub, &ns, loc, &mut model, &mut next, step * 3).await?; // six additions
    }
    fixtures::apply(
        &hub,
        &fixtures::network_service_resource(),
        &fixtures::network_service(&ns, "churn", "churn"),
    )
    .await?;
    wait_model(&hub, &ns, loc, &model, CONVERGE).await;
    for step in 0..9 {
        churn(&hub, &ns, loc, &mut model, &mut next, step).await?;
    }
    wait_model(&hub, &ns, loc, &model, CONVERGE).await;
    // The standby kept warm caches and wrote nothing.
    assert_eq!(
        second.metric("replicator_membership_status_writes_total", &[]).await?,
        Some(0.0)
    );
    assert_eq!(
        second.metric("replicator_membership_passes_total", &[]).await?,
        Some(0.0)
    );

    // SIGKILL the leader: it cannot release the Lease. Churn goes on while nobody leads.
    let mut first = first;
    let killed = Instant::now();
    first.kill().await?;
    for step in 0..9 {
        churn(&hub, &ns, loc, &mut model, &mut next, step).await?;
    }
    wait::until(duration * 4, "the standby takes the Lease", || async {
        Ok::<_, String>(lease_holder(&hub, &lease).await.filter(|h| h == second.identity()))
    })
    .await?;
    let takeover = killed.elapsed();
    eprintln!(
        "leader {} SIGKILLed; {} holds the Lease after {takeover:?} (Lease duration {duration:?})",
        first.identity(),
        second.identity()
    );
    assert!(
        takeover < duration * 3,
        "taken over in {takeover:?}, the Lease lasts {duration:?}"
    );
    assert_eq!(leading(&second).await, Some(1.0));
    for step in 0..9 {
        churn(&hub, &ns, loc, &mut model, &mut next, step).await?;
    }
    wait_model(&hub, &ns, loc, &model, CONVERGE).await;
    let writes = second.metric("replicator_membership_status_writes_total", &[]).await?;
    assert!(writes.is_some_and(|w| w > 0.0), "the new leader writes: {writes:?}");
    Ok(())
}
