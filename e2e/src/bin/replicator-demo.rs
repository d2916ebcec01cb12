//! The demo: brings up (or reuses) the local real control plane, deploys the product into the
//! cells as a user does (the image built from the Dockerfile, `config/` applied with
//! `kubectl apply --server-side -k`, the hub kubeconfig Secrets; `replicator membership` on cell-b
//! standing in for the hub's host cluster), writes sample input into both cells and prints the
//! pods, their readiness and the Lease holders beside what reached the hub, per location and
//! kind. Where kubelets cannot run (not root, no writable cgroups) it says why in one line and
//! runs the product as processes instead.
//!
//! Run it with `e2e/demo` (which builds what is missing first). The Deployments stay up after
//! the demo (it prints how to remove them), like the environment.

use std::time::Duration;

use kube::{Api, ResourceExt, api::DynamicObject};
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec, deploy,
    fixtures::{self, CONVERGE},
    node,
};

const NAMESPACE: &str = "demo";
/// The kinds of the sample input, in the tables' order.
const RULES: [&str; 5] = fixtures::SAMPLE_RULES;

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    println!("== bringing up the local control plane (etcd; kube-apiservers hub, cell-a, cell-b, edge-1; Karmada)");
    let env = Environment::ensure_up().await?;
    println!(
        "   {} in {:.1}s",
        if env.reused() { "reused" } else { "started" },
        started.elapsed().as_secs_f64()
    );
    fixtures::routed_namespace(&env, NAMESPACE).await?;

    let cells = [(CELL_A, "dfw"), (CELL_B, "sjc")];
    let mut replicators = Vec::new();
    let mut membership = None;
    // Serialised with the deployed scenarios (they share each cell's replicator-system).
    let _exclusive = if env.has_nodes().await {
        Some(deploy::exclusive(&env).await?)
    } else {
        None
    };
    let pods = if env.has_nodes().await {
        Some(deploy_as_pods(&env, &cells).await?)
    } else {
        let why = node::kubelets_possible()
            .err()
            .unwrap_or_else(|| "the environment was started without them".to_owned());
        println!("== kubelets cannot run here ({why}): running the product as processes");
        for (cell, location) in cells {
            println!("== starting replicator for {} (location {location})", cell.name());
            let mut r = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(cell).location(location)).await?;
            r.wait_ready(Duration::from_secs(60)).await?;
            replicators.push(r);
        }
        println!("== starting replicator membership against the hub");
        let mut m = ReplicatorProcess::spawn(&env, ReplicatorSpec::membership()).await?;
        m.wait_ready(Duration::from_secs(60)).await?;
        membership = Some(m);
        None
    };

    println!("== writing sample input into both cells");
    let mut written = Vec::new();
    for (cell, location) in cells {
        let site = if location == "dfw" { 1 } else { 2 };
        written.push((
            cell,
            location,
            fixtures::sample_input(&env.client(cell).await?, NAMESPACE, location, site).await?,
        ));
    }

    let hub = env.client(HUB).await?;
    println!("== waiting for the hub to converge");
    for (_, location, by_rule) in &written {
        for (rule, names) in by_rule {
            let resource = fixtures::resource(rule)?;
            for name in names.iter().filter(|n| n.as_str() != "empty-pod") {
                fixtures::wait_for(
                    &hub,
                    &resource,
                    NAMESPACE,
                    &copy_name(NAMESPACE, name, location),
                    CONVERGE,
                    "copy",
                    |_| true,
                )
                .await?;
            }
        }
    }

    println!("\nWhat reached the hub (namespace {NAMESPACE}):\n");
    println!("| location | kind | sources in cell | copies on hub | copies |");
    println!("|---|---|---|---|---|");
    for (cell, location, by_rule) in &written {
        let _ = cell;
        for rule in RULES {
            let resource = fixtures::resource(rule)?;
            let api = Api::<DynamicObject>::namespaced_with(hub.clone(), NAMESPACE, &resource);
            let copies = api
                .list(
                    &kube::api::ListParams::default().labels(&format!("replicator.datumapis.com/location={location}")),
                )
                .await?;
            let names: Vec<String> = copies.items.iter().map(|c| short_name(&c.name_any())).collect();
            let sources = by_rule.get(rule).map_or(0, Vec::len);
            println!(
                "| {location} | {} | {sources} | {} | {} |",
                resource.kind,
                copies.items.len(),
                names.join(", ")
            );
        }
    }
    println!("\n(empty-pod has zero endpoints: held, neither published nor withdrawn.)");
    let es = fixtures::resource("endpointslices")?;
    if let Some(copy) = fixtures::get(&hub, &es, NAMESPACE, &copy_name(NAMESPACE, "web-0-dfw", "dfw")).await? {
        println!(
            "SRv6 SID on web-0-dfw-dfw: {}",
            copy.annotations()
                .get(fixtures::SRV6_SID_ANNOTATION)
                .map_or("(none: the annotation did not arrive)", String::as_str)
        );
    }

    println!("\n== a NetworkService on the hub selecting compute.datumapis.com/workload=web");
    let services = fixtures::network_service_resource();
    fixtures::apply(&hub, &services, &fixtures::network_service(NAMESPACE, "web", "web")).await?;
    let service = fixtures::wait_for(
        &hub,
        &services,
        NAMESPACE,
        "web",
        CONVERGE,
        "status with 4 members",
        |s| {
            serde_json::to_value(s)
                .map(|v| v["status"]["summary"]["members"] == 4)
                .unwrap_or(false)
        },
    )
    .await?;
    let status = serde_json::to_value(&service)?["status"].clone();
    println!(
        "summary: {} members, {} healthy, {} locations",
        status["summary"]["members"], status["summary"]["healthy"], status["summary"]["locations"]
    );
    println!("| location | members | healthy | serving |\n|---|---|---|---|");
    for l in status["locations"].as_array().into_iter().flatten() {
        println!(
            "| {} | {} | {} | {} |",
            l["name"].as_str().unwrap_or_default(),
            l["members"],
            l["healthy"],
            l["serving"]
        );
    }
    for c in status["conditions"].as_array().into_iter().flatten() {
        println!(
            "condition {}={} ({}): {}",
            c["type"].as_str().unwrap_or_default(),
            c["status"].as_str().unwrap_or_default(),
            c["reason"].as_str().unwrap_or_default(),
            c["message"].as_str().unwrap_or_default()
        );
    }
    let slices = Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::namespaced(hub.clone(), NAMESPACE)
        .list(&kube::api::ListParams::default().labels("networking.datumapis.com/network-service=web"))
        .await?;
    for s in &slices.items {
        let endpoints: Vec<String> = s
            .endpoints
            .iter()
            .map(|e| format!("{}@{}", e.addresses.join(","), e.zone.clone().unwrap_or_default()))
            .collect();
        println!(
            "EndpointSlice {} ({}): {}",
            s.name_any(),
            s.address_type,
            endpoints.join(" ")
        );
    }

    println!("\n== applying policies/policies.yaml: Karmada carries the copies on");
    let policies = replicator_e2e::paths::workspace_root()
        .join("policies")
        .join("policies.yaml");
    env.kubectl_ok(
        HUB,
        [
            "apply",
            "--server-side",
            "--field-manager=replicator-demo",
            "-f",
            &policies.display().to_string(),
        ],
    )
    .await?;
    let (ctx, es) = (
        fixtures::resource("networkcontexts")?,
        fixtures::resource("endpointslices")?,
    );
    for member in [CELL_A, CELL_B, Cluster::Edge1] {
        let client = env.client(member).await?;
        fixtures::wait_for(
            &client,
            &es,
            NAMESPACE,
            "web-http",
            Duration::from_secs(60),
            "service slice delivered",
            |_| true,
        )
        .await?;
        if let Some(location) = member.location() {
            let context = copy_name(NAMESPACE, &format!("default-{location}"), location);
            fixtures::wait_for(
                &client,
                &ctx,
                NAMESPACE,
                &context,
                Duration::from_secs(60),
                "context delivered",
                |_| true,
            )
            .await?;
        }
    }
    println!("| member | EndpointSlices delivered | NetworkContexts delivered |\n|---|---|---|");
    for member in [CELL_A, CELL_B, Cluster::Edge1] {
        let client = env.client(member).await?;
        let managed = kube::api::ListParams::default().labels("karmada.io/managed");
        let names = |list: kube::core::ObjectList<kube::api::DynamicObject>| {
            list.items
                .iter()
                .map(|object| short_name(&object.name_any()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let slices = Api::<kube::api::DynamicObject>::namespaced_with(client.clone(), NAMESPACE, &es)
            .list(&managed)
            .await?;
        let contexts = Api::<kube::api::DynamicObject>::namespaced_with(client, NAMESPACE, &ctx)
            .list(&managed)
            .await?;
        println!(
            "| {} | {} ({}) | {} ({}) |",
            member.name(),
            slices.items.len(),
            names(slices.clone()),
            contexts.items.len(),
            names(contexts.clone())
        );
    }
    if let Some(mut m) = membership {
        m.terminate(Duration::from_secs(10)).await?;
    }

    if let Some(pods) = &pods {
        print_pods(&env, pods).await?;
    } else {
        println!("\nReplicators:");
        for r in &replicators {
            let (rss, hwm) = rss_kib(r.pid());
            let text = r.scrape_metrics().await.unwrap_or_default();
            println!(
                "  {}: pid {}, RSS {} KiB (peak {} KiB), {} hub writes (the replicators stop when the demo ends)",
                r.location(),
                r.pid(),
                rss,
                hwm,
                hub_writes(&text, r.location())
            );
        }
    }
    println!("\nLook for yourself:");
    println!(
        "  ~/.cache/replicator/bin/kubernetes-v1.35.4/kubectl --kubeconfig {} get networkinterfaces,endpointslices -n {NAMESPACE} -L replicator.datumapis.com/location",
        env.kubeconfig_path(HUB).display()
    );
    if let Some(pods) = &pods {
        println!(
            "\n== removing the Deployments (kubectl delete -k, as a user would), so that the scenarios find the cells free"
        );
        deploy::undeploy(&env, &pods.applied).await?;
        println!("   done: the copies stay on the hub until a replicator of their location sweeps them");
    }
    println!("Stop the environment: target/debug/replicator-env down");
    for mut r in replicators {
        r.terminate(Duration::from_secs(10)).await?;
    }
    println!("demo done in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// A long name cut for a table: its head and tail and its length.
fn short_name(name: &str) -> String {
    if name.chars().count() > 60 {
        let head: String = name.chars().take(24).collect();
        let tail: String = name.chars().skip(name.chars().count() - 28).collect();
        format!("{head}…{tail} ({} chars)", name.chars().count())
    } else {
        name.to_owned()
    }
}

/// Creates and updates by a replicator, from its `/metrics` text.
fn hub_writes(metrics: &str, location: &str) -> f64 {
    ["create", "update"]
        .iter()
        .map(|op| {
            RULES
                .iter()
                .filter_map(|rule| fixtures::kind(rule).ok())
                .filter_map(|k| {
                    replicator_e2e::metric_value(
                        metrics,
                        "replicator_writes_total",
                        &[("kind", &k.kind), ("location", location), ("op", op)],
                    )
                })
                .sum::<f64>()
        })
        .sum::<f64>()
        + 0.0 // an empty sum is -0.0
}

/// What the demo deployed as pods.
struct Deployed {
    /// The kustomizations applied, by cluster (to remove them).
    applied: Vec<(Cluster, std::path::PathBuf)>,
    /// `(cell, location)` of every `replicator run` Deployment.
    cells: Vec<(Cluster, &'static str)>,
}

/// The README's Deploying steps against the local clusters: hub RBAC and each location's hub
/// identity (`replicator-<location>`); per cell its overlay pinned to the local image, then the
/// hub kubeconfig Secret of its location's identity; `replicator membership` on cell-b
/// (standing in for the hub's host cluster) with its own Secret. Waits until every pod is Ready.
async fn deploy_as_pods(env: &Environment, cells: &[(Cluster, &'static str)]) -> anyhow::Result<Deployed> {
    let images = env.ensure_images().await?;
    println!("== deploying the product as pods: image {}", images.replicator);
    deploy::apply_hub_rbac(env).await?;
    let mut applied = Vec::new();
    // Each location's hub identity, replicator-<location> (config/overlays/<location>/hub).
    for (_, location) in cells {
        let (dir, _) = deploy::hub_identity_overlay(location)?;
        deploy::apply(env, HUB, &dir).await?;
        applied.push((HUB, dir));
    }
    let secrets = deploy::deploy_dir().join("demo-secrets");
    std::fs::create_dir_all(&secrets)?;
    for (cell, location) in cells {
        let dir = deploy::write_overlay(
            &format!("demo-{location}"),
            deploy::Base::Overlay(location),
            &images.replicator,
        )?;
        deploy::apply(env, *cell, &dir).await?;
        let kubeconfig = secrets.join(format!("hub-{location}.kubeconfig"));
        deploy::write_hub_kubeconfig(env, &deploy::run_service_account(location), &kubeconfig).await?;
        deploy::replace_secret(env, *cell, deploy::HUB_SECRET, &kubeconfig).await?;
        println!(
            "   {}: config/overlays/{location} pinned to the image, Secret {} created",
            cell.name(),
            deploy::HUB_SECRET
        );
        applied.push((*cell, dir));
    }
    let dir = deploy::write_overlay("demo-membership", deploy::Base::Membership, &images.replicator)?;
    deploy::apply(env, CELL_B, &dir).await?;
    let kubeconfig = secrets.join("hub-membership.kubeconfig");
    deploy::write_hub_kubeconfig(env, deploy::MEMBERSHIP_SERVICE_ACCOUNT, &kubeconfig).await?;
    deploy::replace_secret(env, CELL_B, deploy::MEMBERSHIP_SECRET, &kubeconfig).await?;
    println!(
        "   cell-b (as the hub's host cluster): config/hub, Secret {}",
        deploy::MEMBERSHIP_SECRET
    );
    applied.push((CELL_B, dir));
    for (cell, _) in cells {
        deploy::wait_pods_ready(&env.client(*cell).await?, deploy::CELL_SELECTOR, 2, POD_READY).await?;
    }
    deploy::wait_pods_ready(&env.client(CELL_B).await?, deploy::MEMBERSHIP_SELECTOR, 2, POD_READY).await?;
    Ok(Deployed {
        applied,
        cells: cells.to_vec(),
    })
}

/// How long the pods may take to be Ready (the image is imported; about 5 s measured).
const POD_READY: Duration = Duration::from_secs(120);

/// The pods, their readiness and restarts, and who holds each location's Lease, with each
/// replicator's hub writes from its `/metrics`.
async fn print_pods(env: &Environment, deployed: &Deployed) -> anyhow::Result<()> {
    let hub = env.client(HUB).await?;
    println!("\nThe product's pods:\n");
    println!("| cluster | pod | ready | restarts | pod IP | role |");
    println!("|---|---|---|---|---|---|");
    let mut writes = Vec::new();
    for (cell, location) in &deployed.cells {
        let client = env.client(*cell).await?;
        let holder = deploy::lease_holder(&hub, location).await?;
        for pod in deploy::pods(&client, deploy::CELL_SELECTOR).await? {
            let name = pod.name_any();
            let leads = holder.as_ref().is_some_and(|h| h.pod() == name);
            let text = deploy::scrape_metrics(&pod).await.unwrap_or_default();
            if leads {
                writes.push((*location, hub_writes(&text, location), name.clone()));
            }
            println!(
                "| {} | {name} | {} | {} | {} | replicator run, location {location}, {} |",
                cell.name(),
                if deploy::is_ready(&pod) { "yes" } else { "no" },
                deploy::restart_count(&pod),
                deploy::pod_ip(&pod).unwrap_or("-"),
                if leads { "leader" } else { "standby" }
            );
        }
    }
    for pod in deploy::pods(&env.client(CELL_B).await?, deploy::MEMBERSHIP_SELECTOR).await? {
        println!(
            "| cell-b | {} | {} | {} | {} | replicator membership |",
            pod.name_any(),
            if deploy::is_ready(&pod) { "yes" } else { "no" },
            deploy::restart_count(&pod),
            deploy::pod_ip(&pod).unwrap_or("-"),
        );
    }
    println!("\nLeases on the hub (replicator-system):");
    for (_, location) in &deployed.cells {
        match deploy::lease_holder(&hub, location).await? {
            Some(holder) => println!("  {}: held by {}", deploy::lease_name(location), holder.identity),
            None => println!("  {}: not held", deploy::lease_name(location)),
        }
    }
    for (location, count, pod) in writes {
        println!("  {location}: {count} hub writes by the leader {pod} (its /metrics)");
    }
    Ok(())
}
