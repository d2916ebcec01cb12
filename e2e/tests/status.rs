//! `replicator status` and JSON logs on the real local control plane (issue #6, "Operator view").
//!
//! Replicators for `dfw` (cell-a) and `sjc` (cell-b) publish sources of a namespace of the
//! scenario's own; drift is made while `dfw` is stopped (a copy edited on the hub, a source
//! deleted, another created) and `replicator status` must report exactly that, with the lag
//! percentiles of the running replicator, then report convergence once `dfw` is back. Waits poll
//! a condition with a deadline; nothing sleeps to synchronise.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::PathBuf, time::Duration};

use kube::{
    Api,
    api::{DynamicObject, Patch, PatchParams},
};
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, CONVERGE, unique},
    wait,
};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

async fn start(env: &Environment, spec: ReplicatorSpec) -> ReplicatorProcess {
    let mut process = ReplicatorProcess::spawn(env, spec).await.unwrap();
    process.wait_ready(Duration::from_secs(60)).await.unwrap();
    process
}

/// Runs `replicator status --hub-kubeconfig <hub> <args>`; returns exit success, stdout, stderr.
async fn status(hub_kubeconfig: &std::path::Path, args: &[String]) -> (bool, String, String) {
    let run = tokio::process::Command::new(ReplicatorProcess::binary_path())
        .arg("status")
        .arg("--hub-kubeconfig")
        .arg(hub_kubeconfig)
        .args(args)
        .env_remove("RUST_LOG")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("replicator status finished within 60 s")
        .expect("replicator status started");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn row<'a>(report: &'a Value, location: &str, kind: &str) -> &'a Value {
    report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["location"] == location && r["kind"] == kind)
        .unwrap_or_else(|| panic!("no row {location}/{kind} in {report:#}"))
}

fn drift(row: &Value) -> [u64; 4] {
    let d = &row["drift"];
    ["inSync", "drifted", "orphans", "missing"].map(|k| d[k].as_u64().unwrap_or_else(|| panic!("{k} in {row}")))
}

/// Checks the lag of a row: observations counted, percentiles ordered, positive and under the
/// convergence deadline.
fn assert_lag_plausible(row: &Value, at_least: u64) {
    let lag = &row["lag"];
    let count = lag["count"].as_u64().unwrap_or_else(|| panic!("lag count in {row}"));
    assert!(
        count >= at_least,
        "{count} observations, expected at least {at_least}: {row}"
    );
    let [p50, p95, p99] = ["p50", "p95", "p99"].map(|p| lag[p].as_f64().unwrap_or_else(|| panic!("{p} in {row}")));
    assert!(0.0 < p50 && p50 <= p95 && p95 <= p99, "{row}");
    assert!(
        p99 < CONVERGE.as_secs_f64(),
        "p99 {p99}s is past the convergence deadline: {row}"
    );
}

async fn lag_count(process: &ReplicatorProcess, kind: &str) -> Option<f64> {
    process
        .metric(
            "replicator_propagation_lag_seconds_count",
            &[("kind", kind), ("location", process.location())],
        )
        .await
        .ok()
        .flatten()
}

#[tokio::test]
async fn status_reports_copies_sources_drift_and_lag_per_location() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("status");
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &["dfw", "sjc"]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell_a, cell_b, hub) = (
        env.client(CELL_A).await?,
        env.client(CELL_B).await?,
        env.client(HUB).await?,
    );
    let ni = fixtures::resource("networkinterfaces")?;
    let es = fixtures::resource("endpointslices")?;
    let interface =
        |name: &str, location: &str| fixtures::network_interface(&ns, name, "default", name, "web", location);

    let mut dfw = start(&env, ReplicatorSpec::new(CELL_A).location("dfw")).await;
    let sjc = start(&env, ReplicatorSpec::new(CELL_B).location("sjc")).await;
    for name in ["web-0", "web-1", "web-2"] {
        fixtures::apply(&cell_a, &ni, &interface(name, "dfw")).await?;
    }
    for name in ["api-0", "api-1"] {
        fixtures::apply(&cell_b, &ni, &interface(name, "sjc")).await?;
    }
    fixtures::apply(
        &cell_b,
        &es,
        &fixtures::galactic_slice(&ns, "pod-a", json!([fixtures::pod_endpoint("fd20::a", "pod-a")]), None),
    )
    .await?;
    for (location, name) in [
        ("dfw", "web-0"),
        ("dfw", "web-1"),
        ("dfw", "web-2"),
        ("sjc", "api-0"),
        ("sjc", "api-1"),
    ] {
        fixtures::wait_for(
            &hub,
            &ni,
            &ns,
            &copy_name(&ns, name, location),
            CONVERGE,
            "copy",
            |_| true,
        )
        .await?;
    }
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "pod-a", "sjc"),
        CONVERGE,
        "copy",
        |_| true,
    )
    .await?;
    // A copy shows on the hub before the writer records its lag: wait for the histogram.
    wait::until(CONVERGE, "sjc's lag histogram to count its writes", || async {
        Ok::<_, String>((lag_count(&sjc, "NetworkInterface").await >= Some(2.0)).then_some(()))
    })
    .await?;

    // Drift while dfw is stopped: an owned field edited on the hub, a source deleted and one
    // created in the cell.
    let dfw_metrics = dfw.metrics_url();
    dfw.terminate(Duration::from_secs(10)).await?;
    let edited = copy_name(&ns, "web-0", "dfw");
    Api::<DynamicObject>::namespaced_with(hub.clone(), &ns, &ni)
        .patch(
            &edited,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"mtu": 8856}})),
        )
        .await?;
    fixtures::delete(&cell_a, &ni, &ns, "web-1").await?;
    fixtures::apply(&cell_a, &ni, &interface("web-3", "dfw")).await?;

    let hub_kubeconfig = env.kubeconfig_path(HUB);
    let kubeconfig = |c: Cluster| env.kubeconfig_path(c).display().to_string();
    let mut args: Vec<String> = [
        "--namespace",
        &ns,
        "--cell",
        &format!("dfw={}", kubeconfig(CELL_A)),
        "--cell",
        &format!("sjc={}", kubeconfig(CELL_B)),
        "--cell",
        "lax=/nonexistent/lax.kubeconfig",
        "--metrics",
        &format!("dfw={dfw_metrics}"),
        "--metrics",
        &sjc.metrics_url(),
        "--metrics",
        "lax=http://127.0.0.1:1/metrics",
        "--timeout",
        "5s",
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(["--output", "json"].map(str::to_owned));
    let (ok, out, err) = status(&hub_kubeconfig, &args).await;
    assert!(ok, "replicator status failed: {err}\n{out}");
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    eprintln!("{out}");
    assert_eq!(report["namespace"], json!(ns));

    let dfw_ni = row(&report, "dfw", "NetworkInterface");
    assert_eq!(dfw_ni["copies"], 3, "web-0, web-1 and web-2 copies: {dfw_ni}");
    assert_eq!(dfw_ni["sources"], 3, "web-0, web-2 and web-3: {dfw_ni}");
    assert_eq!(
        drift(dfw_ni),
        [1, 1, 1, 1],
        "web-2 in sync, web-0 drifted, web-1 orphan, web-3 missing"
    );
    assert_eq!(dfw_ni["cell"], "ok");
    assert_eq!(dfw_ni["metrics"], "unreachable", "dfw is stopped: {dfw_ni}");
    assert!(dfw_ni["lastWrite"].as_str().is_some(), "{dfw_ni}");
    assert_eq!(dfw_ni["lag"], Value::Null);
    let dfw_errors = dfw_ni["errors"].as_array().unwrap();
    assert!(
        dfw_errors.len() == 1 && dfw_errors[0].as_str().unwrap().starts_with("metrics http://"),
        "{dfw_ni}"
    );

    let sjc_ni = row(&report, "sjc", "NetworkInterface");
    assert_eq!(
        (sjc_ni["copies"].as_u64(), sjc_ni["sources"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(drift(sjc_ni), [2, 0, 0, 0]);
    assert_eq!(sjc_ni["metrics"], "ok");
    assert_eq!(sjc_ni["leader"], true);
    assert!(sjc_ni["lastSync"].as_str().is_some(), "{sjc_ni}");
    assert_lag_plausible(sjc_ni, 2);
    let sjc_es = row(&report, "sjc", "EndpointSlice");
    assert_eq!(
        (sjc_es["copies"].as_u64(), sjc_es["sources"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(drift(sjc_es), [1, 0, 0, 0]);
    assert_lag_plausible(sjc_es, 1);
    for kind in ["Network", "NetworkContext", "Subnet"] {
        let r = row(&report, "sjc", kind);
        assert_eq!((r["copies"].as_u64(), r["sources"].as_u64()), (Some(0), Some(0)), "{r}");
    }
    let dfw_es = row(&report, "dfw", "EndpointSlice");
    assert_eq!(
        (dfw_es["copies"].as_u64(), dfw_es["sources"].as_u64()),
        (Some(0), Some(0))
    );

    // The unreachable cell and metrics endpoint show in their rows and abort nothing.
    let lax = row(&report, "lax", "NetworkInterface");
    assert_eq!(lax["cell"], "unreachable");
    assert_eq!(lax["metrics"], "unreachable");
    assert_eq!(lax["copies"], 0);
    assert_eq!(lax["sources"], Value::Null);
    assert_eq!(lax["errors"].as_array().map(Vec::len), Some(2), "{lax}");

    // The same as a table: the drift in the dfw line, the unreachable inputs listed below.
    args.truncate(args.len() - 2);
    let (ok, table, err) = status(&hub_kubeconfig, &args).await;
    assert!(ok, "replicator status failed: {err}\n{table}");
    eprintln!(
        "$ replicator status --hub-kubeconfig hub.kubeconfig {}\n{table}",
        args.join(" ")
    );
    let dfw_line = table
        .lines()
        .find(|l| l.starts_with("dfw ") && l.contains("NetworkInterface"))
        .unwrap_or_else(|| panic!("{table}"));
    let cells: Vec<&str> = dfw_line.split_whitespace().collect();
    assert_eq!(cells[2..8], ["3", "3", "1", "1", "1", "1"], "{table}");
    assert!(dfw_line.ends_with("metrics unreachable"), "{table}");
    assert!(
        table.contains("\nproblems:\n") && table.contains("  cell lax: kubeconfig /nonexistent/lax.kubeconfig"),
        "{table}"
    );

    // dfw back: it repairs the edit, collects the orphan and creates the missing copy.
    let dfw = start(&env, ReplicatorSpec::new(CELL_A).location("dfw")).await;
    fixtures::wait_gone(&hub, &ni, &ns, &copy_name(&ns, "web-1", "dfw"), CONVERGE).await?;
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "web-3", "dfw"),
        CONVERGE,
        "copy",
        |_| true,
    )
    .await?;
    fixtures::wait_for(&hub, &ni, &ns, &edited, CONVERGE, "edit repaired", |o| {
        o.data["spec"]["mtu"] == 1460
    })
    .await?;
    wait::until(CONVERGE, "dfw's lag histogram to count its repairs", || async {
        Ok::<_, String>((lag_count(&dfw, "NetworkInterface").await >= Some(2.0)).then_some(()))
    })
    .await?;
    let args: Vec<String> = [
        "--namespace",
        &ns,
        "--cell",
        &format!("dfw={}", kubeconfig(CELL_A)),
        "--cell",
        &format!("sjc={}", kubeconfig(CELL_B)),
        "--metrics",
        &dfw.metrics_url(),
        "--metrics",
        &sjc.metrics_url(),
        "-o",
        "json",
    ]
    .map(str::to_owned)
    .to_vec();
    let (ok, out, err) = status(&hub_kubeconfig, &args).await;
    assert!(ok, "replicator status failed: {err}\n{out}");
    let report: Value = serde_json::from_str(&out)?;
    let dfw_ni = row(&report, "dfw", "NetworkInterface");
    assert_eq!(
        (dfw_ni["copies"].as_u64(), dfw_ni["sources"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(drift(dfw_ni), [3, 0, 0, 0], "{dfw_ni}");
    assert_eq!(dfw_ni["leader"], true);
    assert_eq!(dfw_ni["metrics"], "ok");
    assert!(dfw_ni["errors"].as_array().unwrap().is_empty(), "{dfw_ni}");
    assert_lag_plausible(dfw_ni, 2);

    // The table an operator reads: a header, one line per location and kind.
    let args: Vec<String> = args.into_iter().filter(|a| a != "-o" && a != "json").collect();
    let (ok, table, err) = status(&hub_kubeconfig, &args).await;
    assert!(ok, "replicator status failed: {err}\n{table}");
    eprintln!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("LOCATION  KIND"), "{table}");
    let dfw_line: Vec<&str> = lines
        .iter()
        .find(|l| l.starts_with("dfw ") && l.contains("NetworkInterface"))
        .unwrap_or_else(|| panic!("{table}"))
        .split_whitespace()
        .collect();
    assert_eq!(dfw_line[2..8], ["3", "3", "3", "0", "0", "0"], "{table}");
    for location in ["dfw ", "sjc "] {
        let rows = lines.iter().filter(|l| l.starts_with(location)).count();
        assert_eq!(rows, 5, "a line per kind for {location}:\n{table}");
    }
    Ok(())
}

#[tokio::test]
async fn status_fails_clearly_when_the_hub_is_unreachable() -> TestResult {
    let env = Environment::ensure_up().await?;
    let good = std::fs::read_to_string(env.kubeconfig_path(HUB))?;
    let server = env.server_url(HUB);
    assert!(good.contains(&server), "the hub kubeconfig names {server}");
    let dir = env.dir().join("status-test");
    std::fs::create_dir_all(&dir)?;
    let closed: PathBuf = dir.join("closed-hub.kubeconfig");
    std::fs::write(&closed, good.replace(&server, "https://127.0.0.1:1"))?;
    let (ok, out, err) = status(&closed, &["--timeout".into(), "5s".into()]).await;
    assert!(!ok, "status succeeded against a closed port: {out}");
    assert!(out.is_empty(), "nothing printed on stdout: {out}");
    assert!(
        err.contains("is unreachable") && err.contains(&closed.display().to_string()),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn json_logs_carry_cluster_kind_namespace_and_name() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("jsonlog"), unique("loc"));
    let _teardown = fixtures::Teardown::scenario(&env, &ns, &[&loc]);
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;
    let mut r = start(
        &env,
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .args(["--log-format", "json"])
            .env("RUST_LOG", "info,replicator=debug"),
    )
    .await;
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "good", "default", "claim", "web", &loc),
    )
    .await?;
    // A claim name too long for a label value: the source cannot be copied.
    let long_claim = "c".repeat(70);
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "bad", "default", &long_claim, "web", &loc),
    )
    .await?;
    fixtures::wait_for(&hub, &ni, &ns, &copy_name(&ns, "good", &loc), CONVERGE, "copy", |_| {
        true
    })
    .await?;
    wait::until(CONVERGE, "the invalid source counted", || {
        let r = &r;
        async move {
            let n = r
                .metric(
                    "replicator_errors_total",
                    &[("kind", "NetworkInterface"), ("class", "source_invalid")],
                )
                .await?;
            Ok::<_, replicator_e2e::Error>((n >= Some(1.0)).then_some(()))
        }
    })
    .await?;
    r.terminate(Duration::from_secs(10)).await?;
    // Leave no uncopyable source behind: every later replicator of the cell would count it.
    fixtures::delete(&cell, &ni, &ns, "bad").await?;

    let log = std::fs::read_to_string(r.log_path())?;
    let mut lines = Vec::new();
    for line in log.lines().filter(|l| !l.starts_with("=== replicator-e2e")) {
        match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(map)) => lines.push(map),
            other => panic!("not a JSON object: {line}: {other:?}"),
        }
    }
    let find = |message: &str, name: &str| {
        lines
            .iter()
            .find(|l| {
                l["message"] == message && l.get("name") == Some(&json!(name)) && l.get("namespace") == Some(&json!(ns))
            })
            .unwrap_or_else(|| panic!("no line {message:?} for {ns}/{name} in\n{log}"))
    };
    for (message, name) in [("copy applied", "good"), ("sync failed", "bad")] {
        let line = find(message, name);
        assert_eq!(line["cluster"], "cell", "{line:?}");
        assert_eq!(line["kind"], "NetworkInterface", "{line:?}");
        assert_eq!(line["location"], json!(loc), "{line:?}");
    }
    assert_eq!(find("sync failed", "bad")["class"], "source_invalid");
    // Every line about an object names it fully; every line about a kind names its cluster.
    for line in &lines {
        if line.contains_key("name") || line.contains_key("namespace") {
            for key in ["cluster", "kind", "namespace", "name"] {
                assert!(line.contains_key(key), "{key} missing: {line:?}");
            }
        }
        if line.contains_key("kind") {
            assert!(line.contains_key("cluster"), "cluster missing: {line:?}");
        }
    }
    let listed: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter(|l| l["message"] == "cell list complete" && l["cluster"] == "cell")
        .filter_map(|l| l["kind"].as_str())
        .collect();
    assert_eq!(
        listed.into_iter().collect::<Vec<_>>(),
        [
            "EndpointSlice",
            "Network",
            "NetworkContext",
            "NetworkInterface",
            "Subnet"
        ],
        "a list line per kind, each with cluster and kind:\n{log}"
    );
    Ok(())
}
