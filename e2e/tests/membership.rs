//! NetworkService membership on the real control plane (issue 4, §1 and §3): CEL validation on a
//! real apiserver, and `replicator membership` resolving interfaces mirrored from two cells by
//! `replicator run`.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use replicator::api::NetworkService;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, CONVERGE, unique},
    wait,
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
    fixtures::namespace(&env, &[HUB], &ns, true).await?;
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
    Ok(())
}

#[tokio::test]
async fn membership_follows_interfaces_mirrored_from_two_cells() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, workload, loc_a, loc_b) = (unique("svc"), unique("wl"), unique("dfw"), unique("sjc"));
    fixtures::routed_namespace(&env, &ns).await?;
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
    fixtures::routed_namespace(&env, &ns).await?;
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
            ("big-http-1".into(), 100),
            ("big-http-2".into(), 50)
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
                "dual-http-ipv4".into(),
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
        async move { m.metric(name, &[]).await.unwrap().unwrap_or(0.0) }
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
