//! `config/monitoring` observed as deployed (issue "Observed as deployed", §1 and §2):
//!
//! - `promtool_checks_and_unit_tests_every_alert` (no environment): the PrometheusRule's `spec`
//!   written out as a plain rules file passes `promtool check rules`, and the unit tests of
//!   `config/monitoring/tests/` pass `promtool test rules`; every alert has a case where it fires
//!   and one where it stays quiet. Prints the number of cases.
//! - `prometheus_scrapes_the_deployed_product`: the product deployed as the README says (dfw on
//!   cell-a, sjc on cell-b, membership on cell-b), a real Prometheus started as a bare process
//!   with `kubernetes_sd_configs` against each cell's apiserver and a scrape configuration derived
//!   from the ServiceMonitor objects (namespace, Service labels, port, path, interval, timeout),
//!   so the two cannot drift. Under churn it asks Prometheus's HTTP API for the p99 propagation
//!   lag per location, compares `replicator_copies` per location with the copies on the hub,
//!   expects `up` 1 for every target, runs `promtool check metrics` on a live `/metrics` body,
//!   and runs every dashboard panel's expression (template variables substituted as the
//!   dashboard's `templating` defines them) against the live data; the alert rules are loaded
//!   too and must evaluate without error. Prints `prometheus: p99 lag ...; copies ...; up ...`.
//!   Prometheus and everything the scenario made are removed at the end, pass or fail.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail, ensure};
use kube::api::{DynamicObject, ListParams};
use kube::{Api, Client, ResourceExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replicator::rules::LOCATION_LABEL;
use replicator_e2e::binaries::{Binaries, PROMETHEUS_RELEASE};
use replicator_e2e::deploy::{self, Base, CELL_SELECTOR, HUB_SECRET, MEMBERSHIP_SECRET, MEMBERSHIP_SELECTOR, Teardown};
use replicator_e2e::images::Images;
use replicator_e2e::wait::{self, Check};
use replicator_e2e::{CELL_A, CELL_B, Cluster, Environment, HUB, convergence, fixtures, fixtures::unique, paths};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// The name the rule unit tests give the rules file (`rule_files:`), written next to them.
const RULES_FILE: &str = "prometheus_rule.rules.yaml";
/// How long pods may take to be Ready after the Secret exists.
const PODS_READY: Duration = Duration::from_secs(120);
/// How long a location's Lease may take to get a holder once its pods are Ready.
const LEADER: Duration = Duration::from_secs(30);
/// How long Prometheus may take to answer `/-/ready`.
const PROMETHEUS_READY: Duration = Duration::from_secs(60);
/// How long Prometheus may take to see every target up: discovery, then a scrape interval.
const TARGETS_UP: Duration = Duration::from_secs(120);
/// How long the live data may take to show what churn produced (two scrapes of every target).
const OBSERVED: Duration = Duration::from_secs(150);
/// How long the hub may take to match the cells once the churn stops.
const CONVERGED: Duration = Duration::from_secs(60);
/// The churn: a pace and a pool of sources per cell.
const CHURN_TICK: Duration = Duration::from_millis(500);
const CHURN_POOL: usize = 12;
const CHURN_OPS_PER_TICK: usize = 2;
/// How much churn runs before the queries start.
const CHURN_WARMUP: usize = 20;

fn monitoring_dir() -> PathBuf {
    paths::workspace_root().join("config").join("monitoring")
}

fn yaml_documents(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_saphyr::from_multiple::<Value>(&text)
        .with_context(|| format!("parsing {}", path.display()))?
        .into_iter()
        .filter(|v| !v.is_null())
        .collect())
}

/// The PrometheusRule's `spec` (its `groups`), as a plain Prometheus rules file holds them.
fn rule_groups() -> anyhow::Result<Value> {
    let docs = yaml_documents(&monitoring_dir().join("prometheus_rule.yaml"))?;
    let [rule] = docs.as_slice() else {
        bail!("prometheus_rule.yaml holds {} objects, not one", docs.len());
    };
    ensure!(rule["kind"] == "PrometheusRule", "{}", rule["kind"]);
    let groups = &rule["spec"]["groups"];
    ensure!(
        groups.as_array().is_some_and(|g| !g.is_empty()),
        "no spec.groups: {rule}"
    );
    ensure!(
        rule["spec"].as_object().is_some_and(|spec| spec.len() == 1),
        "spec has more than groups: {}",
        rule["spec"]
    );
    Ok(json!({ "groups": groups }))
}

/// Every alert name of `groups`.
fn alert_names(groups: &Value) -> BTreeSet<String> {
    groups["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

/// The files of `config/monitoring/tests/`, sorted.
fn rule_test_files() -> anyhow::Result<Vec<PathBuf>> {
    let dir = monitoring_dir().join("tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"));
    files.sort();
    ensure!(!files.is_empty(), "no rule tests in {}", dir.display());
    Ok(files)
}

/// A directory of this run's own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(parent: &Path, name: &str) -> anyhow::Result<Scratch> {
        let dir = parent.join(unique(name));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `command` (stdin from `input` when given) and returns its status and combined output.
async fn run(command: &mut Command, input: Option<&str>) -> anyhow::Result<(std::process::ExitStatus, String)> {
    command
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().with_context(|| format!("running {command:?}"))?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(input.as_bytes()).await?;
    }
    let out = child.wait_with_output().await?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status, text))
}

// ---------------------------------------------------------------------------------------------
// 1. promtool on the rules (no environment).
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn promtool_checks_and_unit_tests_every_alert() -> TestResult {
    let binaries = Binaries::ensure().await?;
    let (status, version) = run(Command::new(&binaries.promtool).arg("--version"), None).await?;
    ensure!(
        status.success() && version.contains(&format!("version {PROMETHEUS_RELEASE}")),
        "promtool --version: {version}"
    );
    let scratch = Scratch::new(&std::env::temp_dir(), "replicator-promtool")?;
    let groups = rule_groups()?;
    let rules = scratch.path(RULES_FILE);
    std::fs::write(&rules, serde_saphyr::to_string(&groups)?)?;

    let (status, out) = run(
        Command::new(&binaries.promtool)
            .args(["check", "rules", "--lint=all", "--lint-fatal"])
            .arg(&rules),
        None,
    )
    .await?;
    ensure!(status.success(), "promtool check rules: {status}\n{out}");
    eprintln!("promtool check rules: {}", out.trim().replace('\n', " "));

    // Each test file names the rules file by its bare name: promtool resolves it next to the
    // test file, so the tests run from the scratch directory.
    let alerts = alert_names(&groups);
    let (mut firing, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    let (mut cases, mut tests, mut names) = (0usize, 0usize, Vec::new());
    for file in rule_test_files()? {
        let name = file
            .file_name()
            .context("test file name")?
            .to_string_lossy()
            .into_owned();
        std::fs::copy(&file, scratch.path(&name))?;
        let [doc] = yaml_documents(&file)?
            .try_into()
            .map_err(|_| anyhow!("{name}: not one document"))?;
        ensure!(
            doc["rule_files"] == json!([RULES_FILE]),
            "{name}: rule_files {}",
            doc["rule_files"]
        );
        for test in doc["tests"].as_array().context("tests")? {
            tests += 1;
            for case in test["alert_rule_test"].as_array().into_iter().flatten() {
                cases += 1;
                let alert = case["alertname"].as_str().context("alertname")?.to_owned();
                ensure!(alerts.contains(&alert), "{name}: {alert} is not an alert of the rules");
                if case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()) {
                    firing.insert(alert);
                } else {
                    quiet.insert(alert);
                }
            }
        }
        names.push(name);
    }
    let (status, out) = run(
        Command::new(&binaries.promtool)
            .current_dir(&scratch.0)
            .args(["test", "rules"])
            .args(&names),
        None,
    )
    .await?;
    ensure!(status.success(), "promtool test rules: {status}\n{out}");
    let never_fire: Vec<_> = alerts.difference(&firing).collect();
    let never_quiet: Vec<_> = alerts.difference(&quiet).collect();
    ensure!(
        never_fire.is_empty() && never_quiet.is_empty(),
        "alerts without a firing case: {never_fire:?}; without a quiet case: {never_quiet:?}"
    );
    eprintln!(
        "promtool: {cases} alert test cases in {tests} tests ({}) cover all {} alerts, each firing and quiet: all pass",
        names.join(", "),
        alerts.len()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. A real Prometheus scraping the deployed product.
// ---------------------------------------------------------------------------------------------

/// What the scrape configuration is derived from: one ServiceMonitor endpoint.
#[derive(Debug, Clone)]
struct Monitor {
    name: String,
    index: usize,
    namespaces: Vec<String>,
    labels: BTreeMap<String, String>,
    port: String,
    path: String,
    interval: String,
    timeout: String,
}

/// The endpoints of `config/monitoring/service_monitors.yaml`. Fails on any field this
/// translation does not carry over, so a ServiceMonitor cannot say more than the scrape does.
fn service_monitors() -> anyhow::Result<Vec<Monitor>> {
    let mut monitors = Vec::new();
    for sm in yaml_documents(&monitoring_dir().join("service_monitors.yaml"))? {
        ensure!(sm["kind"] == "ServiceMonitor", "{}", sm["kind"]);
        let name = sm["metadata"]["name"].as_str().context("name")?.to_owned();
        let spec = sm["spec"].as_object().context("spec")?;
        let known = ["namespaceSelector", "selector", "endpoints"];
        ensure!(
            spec.keys().all(|k| known.contains(&k.as_str())),
            "{name}: spec fields beyond {known:?}: {spec:?}"
        );
        let ns_selector = spec["namespaceSelector"].as_object().context("namespaceSelector")?;
        ensure!(
            ns_selector.keys().all(|k| k == "matchNames"),
            "{name}: namespaceSelector {ns_selector:?}"
        );
        let namespaces: Vec<String> = ns_selector["matchNames"]
            .as_array()
            .context("matchNames")?
            .iter()
            .map(|n| n.as_str().map(str::to_owned).context("namespace"))
            .collect::<anyhow::Result<_>>()?;
        let selector = spec["selector"].as_object().context("selector")?;
        ensure!(
            selector.keys().all(|k| k == "matchLabels"),
            "{name}: selector {selector:?}"
        );
        let labels: BTreeMap<String, String> = serde_json::from_value(selector["matchLabels"].clone())?;
        ensure!(!labels.is_empty(), "{name}: empty selector");
        for (index, ep) in spec["endpoints"].as_array().context("endpoints")?.iter().enumerate() {
            let fields = ep.as_object().context("endpoint")?;
            let known = ["port", "path", "interval", "scrapeTimeout"];
            ensure!(
                fields.keys().all(|k| known.contains(&k.as_str())),
                "{name}: endpoint fields beyond {known:?}: {fields:?}"
            );
            let field = |k: &str, default: &str| fields.get(k).and_then(Value::as_str).unwrap_or(default).to_owned();
            monitors.push(Monitor {
                name: name.clone(),
                index,
                namespaces: namespaces.clone(),
                labels: labels.clone(),
                port: fields
                    .get("port")
                    .and_then(Value::as_str)
                    .context("endpoint port")?
                    .to_owned(),
                path: field("path", "/metrics"),
                interval: fields
                    .get("interval")
                    .and_then(Value::as_str)
                    .context("interval")?
                    .to_owned(),
                timeout: field("scrapeTimeout", "10s"),
            });
        }
    }
    ensure!(!monitors.is_empty(), "no ServiceMonitor endpoints");
    Ok(monitors)
}

/// A Kubernetes label name as Prometheus's service discovery names it (`__meta_..._<name>`).
fn sanitize(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' })
        .collect()
}

/// `text` as a regular expression matching exactly it.
fn regex_escape(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Seconds of a Prometheus duration such as `30s`, `1m` or `1m30s`.
fn seconds(duration: &str) -> anyhow::Result<u64> {
    let (mut total, mut number) = (0u64, String::new());
    for c in duration.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let n: u64 = number.parse().with_context(|| format!("duration {duration:?}"))?;
        number.clear();
        total += n * match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => bail!("duration {duration:?}: unit {c:?}"),
        };
    }
    ensure!(number.is_empty() && total > 0, "duration {duration:?}");
    Ok(total)
}

/// The scrape job the Prometheus Operator generates for `monitor`, with one `endpoints`
/// discovery per cell apiserver (admin server, CA and token of the environment): keep the
/// Services carrying the selector's labels and the endpoint port of the monitor's name; label
/// targets as the operator does (`job` is the Service's name, which the alerts rely on).
fn scrape_job(env: &Environment, monitor: &Monitor, token_file: &Path) -> Value {
    let discovery: Vec<Value> = Cluster::CELLS
        .iter()
        .map(|cell| {
            json!({
                "role": "endpoints",
                "api_server": env.server_url(*cell),
                "tls_config": {"ca_file": env.pki().ca_cert()},
                "authorization": {"type": "Bearer", "credentials_file": token_file},
                "namespaces": {"names": monitor.namespaces},
            })
        })
        .collect();
    let mut relabel = Vec::new();
    for (label, value) in &monitor.labels {
        let label = sanitize(label);
        relabel.push(json!({
            "action": "keep",
            "source_labels": [
                format!("__meta_kubernetes_service_label_{label}"),
                format!("__meta_kubernetes_service_labelpresent_{label}"),
            ],
            "regex": format!("({});true", regex_escape(value)),
        }));
    }
    relabel.push(json!({
        "action": "keep",
        "source_labels": ["__meta_kubernetes_endpoint_port_name"],
        "regex": regex_escape(&monitor.port),
    }));
    relabel.push(json!({
        "action": "drop",
        "source_labels": ["__meta_kubernetes_pod_phase"],
        "regex": "(Failed|Succeeded)",
    }));
    for (target, source) in [
        ("namespace", "__meta_kubernetes_namespace"),
        ("service", "__meta_kubernetes_service_name"),
        ("pod", "__meta_kubernetes_pod_name"),
        ("container", "__meta_kubernetes_pod_container_name"),
        ("job", "__meta_kubernetes_service_name"),
    ] {
        relabel.push(json!({"source_labels": [source], "target_label": target}));
    }
    relabel.push(json!({"target_label": "endpoint", "replacement": monitor.port}));
    json!({
        "job_name": format!("serviceMonitor/{}/{}/{}", monitor.namespaces.join(","), monitor.name, monitor.index),
        "honor_labels": false,
        "scheme": "http",
        "metrics_path": monitor.path,
        "scrape_interval": monitor.interval,
        "scrape_timeout": monitor.timeout,
        "kubernetes_sd_configs": discovery,
        "relabel_configs": relabel,
    })
}

#[test]
fn the_service_monitors_select_the_product_services() -> TestResult {
    // Each metrics Service of the product (config/cell, config/hub) is selected by exactly one
    // ServiceMonitor endpoint, in the namespace its kustomization sets, on a port it has.
    let monitors = service_monitors()?;
    for (dir, service) in [("cell", "replicator"), ("hub", "replicator-membership")] {
        let dir = paths::workspace_root().join("config").join(dir);
        let [kustomization] = yaml_documents(&dir.join("kustomization.yaml"))?
            .try_into()
            .map_err(|_| anyhow!("{}: not one document", dir.display()))?;
        let namespace = kustomization["namespace"].as_str().context("kustomization namespace")?;
        let [svc] = yaml_documents(&dir.join("service.yaml"))?
            .try_into()
            .map_err(|_| anyhow!("{}/service.yaml: not one document", dir.display()))?;
        ensure!(svc["metadata"]["name"] == service, "{svc}");
        let selecting: Vec<&Monitor> = monitors
            .iter()
            .filter(|m| {
                m.namespaces.iter().any(|n| n == namespace)
                    && m.labels.iter().all(|(k, v)| svc["metadata"]["labels"][k] == v.as_str())
            })
            .collect();
        let [monitor] = selecting.as_slice() else {
            bail!("{service}: selected by {selecting:?}");
        };
        let ports = svc["spec"]["ports"].as_array().context("ports")?;
        ensure!(
            ports.iter().any(|p| p["name"] == monitor.port.as_str()),
            "{service} has no port {}: {ports:?}",
            monitor.port
        );
        seconds(&monitor.interval)?;
        seconds(&monitor.timeout)?;
    }
    // Every dashboard expression can be made concrete from its templating.
    let queries = dashboard_queries(30)?;
    ensure!(queries.len() > PANELS_WITH_DATA.len(), "{queries:?}");
    Ok(())
}

/// A Prometheus server run by this test: its files under `<state>/prometheus-<id>/`, killed and
/// removed on drop (its log printed first when the test is failing).
struct Prometheus {
    child: tokio::process::Child,
    dir: PathBuf,
    url: String,
    http: reqwest::Client,
}

impl Prometheus {
    async fn start(env: &Environment, monitors: &[Monitor], rules: &Value) -> anyhow::Result<Prometheus> {
        let binaries = env.binaries().clone();
        let binaries = if binaries.prometheus.is_file() {
            binaries
        } else {
            Binaries::ensure().await?
        };
        let dir = env.dir().join(unique("prometheus"));
        std::fs::create_dir_all(dir.join("data"))?;
        let token_file = dir.join("token");
        write_private(&token_file, env.admin_token())?;
        let rules_file = dir.join(RULES_FILE);
        std::fs::write(&rules_file, serde_saphyr::to_string(rules)?)?;
        let config = json!({
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "rule_files": [rules_file],
            "scrape_configs": monitors.iter().map(|m| scrape_job(env, m, &token_file)).collect::<Vec<_>>(),
        });
        let config_file = dir.join("prometheus.yaml");
        std::fs::write(&config_file, serde_saphyr::to_string(&config)?)?;
        let (status, out) = run(
            Command::new(&binaries.promtool)
                .args(["check", "config", "--lint-fatal"])
                .arg(&config_file),
            None,
        )
        .await?;
        ensure!(status.success(), "promtool check config: {status}\n{out}");

        let port = std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port();
        let log = std::fs::File::create(dir.join("prometheus.log"))?;
        let child = Command::new(&binaries.prometheus)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting prometheus")?;
        let mut prometheus = Prometheus {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(10))
                .build()?,
        };
        let ready = format!("{}/-/ready", prometheus.url);
        let http = prometheus.http.clone();
        let child = &mut prometheus.child;
        wait::until_observed(PROMETHEUS_READY, "prometheus to answer /-/ready", || {
            let exited = child.try_wait();
            let (http, ready) = (http.clone(), ready.clone());
            async move {
                if let Ok(Some(status)) = exited {
                    return Ok::<_, reqwest::Error>(Check::Abort(format!("prometheus exited: {status}")));
                }
                let status = http.get(&ready).send().await?.status();
                Ok(if status.is_success() {
                    Check::Ready(())
                } else {
                    Check::NotYet(format!("/-/ready {status}"))
                })
            }
        })
        .await
        .map_err(|e| anyhow!("{e}\n{}", prometheus.log_tail()))?;
        Ok(prometheus)
    }

    fn log_tail(&self) -> String {
        replicator_e2e::process::log_tail(&self.dir.join("prometheus.log"), 30)
    }

    /// `GET /api/v1/<path>` with `params`: the `data` of a successful answer.
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> anyhow::Result<Value> {
        let response = self
            .http
            .get(format!("{}/api/v1/{path}", self.url))
            .query(params)
            .send()
            .await?;
        let status = response.status();
        let body: Value = serde_json::from_str(&response.text().await?)?;
        ensure!(
            status.is_success() && body["status"] == "success",
            "{path} {params:?}: {status} {body}"
        );
        Ok(body["data"].clone())
    }

    /// An instant query: its result vector.
    async fn query(&self, query: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api("query", &[("query", query)]).await?;
        ensure!(data["resultType"] == "vector", "{query}: {data}");
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// `{label value → sample value}` of an instant query's result.
    async fn by(&self, query: &str, label: &str) -> anyhow::Result<BTreeMap<String, f64>> {
        let mut out = BTreeMap::new();
        for sample in self.query(query).await? {
            let key = sample["metric"][label].as_str().unwrap_or_default().to_owned();
            let value: f64 = sample["value"][1].as_str().context("sample value")?.parse()?;
            out.insert(key, value);
        }
        Ok(out)
    }

    /// Stops Prometheus and removes its directory.
    async fn stop(mut self) -> anyhow::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        std::fs::remove_dir_all(&self.dir)?;
        Ok(())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if !self.dir.exists() {
            return;
        }
        if std::thread::panicking() {
            eprintln!("prometheus log (last lines):\n{}", self.log_tail());
        }
        let _ = self.child.start_kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(self.child.try_wait(), Ok(Some(_)) | Err(_)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

fn image() -> anyhow::Result<String> {
    Ok(Images::read(&Images::dir())?.replicator)
}

/// Every copy `location` holds on the hub, of every default rule's kind.
async fn hub_copies(hub: &Client, location: &str) -> anyhow::Result<usize> {
    let selector = format!("{LOCATION_LABEL}={location}");
    let mut n = 0;
    for rule in replicator::rules::default_rules() {
        let api = Api::<DynamicObject>::all_with(hub.clone(), &rule.resource.api_resource());
        n += api
            .list_metadata(&ListParams::default().labels(&selector))
            .await?
            .items
            .len();
    }
    Ok(n)
}

/// Creates, updates and deletes NetworkInterfaces and galactic EndpointSlices of one cell's
/// namespace, a few per tick, until told to stop; plus one source the hub cannot take (a claim
/// name too long for a label value), so that errors are counted.
async fn churn(
    cell: Client,
    ns: String,
    location: String,
    stop: Arc<AtomicBool>,
    ticks: Arc<AtomicUsize>,
) -> anyhow::Result<usize> {
    let (ni, es) = (
        fixtures::resource("networkinterfaces")?,
        fixtures::resource("endpointslices")?,
    );
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::network_interface(&ns, "uncopyable", "default", &"c".repeat(70), "web", &location),
    )
    .await?;
    let mut rng = StdRng::seed_from_u64(u64::from(location.bytes().map(u32::from).sum::<u32>()));
    let mut live: BTreeMap<(bool, usize), u32> = BTreeMap::new();
    let mut writes = 0;
    // Pacing a load generator, not synchronisation: it writes at a steady rate until told.
    let mut interval = tokio::time::interval(CHURN_TICK);
    while !stop.load(Ordering::Relaxed) {
        interval.tick().await;
        for _ in 0..CHURN_OPS_PER_TICK {
            let key = (rng.random_bool(0.5), rng.random_range(0..CHURN_POOL));
            let (slice, index) = key;
            let name = format!("{}-{index}", if slice { "pod" } else { "nic" });
            let resource = if slice { &es } else { &ni };
            let version = match live.get(&key).copied() {
                Some(_) if rng.random_bool(0.25) => None,
                Some(v) => Some(v + 1),
                None => Some(1),
            };
            match version {
                Some(v) => {
                    let body = if slice {
                        fixtures::galactic_slice(
                            &ns,
                            &name,
                            json!([fixtures::pod_endpoint(&format!("fd20::{v:x}"), &name)]),
                            None,
                        )
                    } else {
                        let mut body = fixtures::network_interface(&ns, &name, "default", &name, "web", &location);
                        body["spec"]["mtu"] = json!(1300 + v);
                        body
                    };
                    fixtures::apply(&cell, resource, &body).await?;
                    live.insert(key, v);
                }
                None => {
                    fixtures::delete(&cell, resource, &ns, &name).await?;
                    live.remove(&key);
                }
            }
            writes += 1;
        }
        ticks.fetch_add(1, Ordering::Relaxed);
    }
    Ok(writes)
}

/// A dashboard panel's query, its template variables substituted.
#[derive(Debug)]
struct PanelQuery {
    title: String,
    ref_id: String,
    expr: String,
}

/// Every panel target of the dashboard (rows' nested panels too), with each variable of its
/// `templating` replaced by what Grafana sends for "All" (`allValue`), and Grafana's
/// `$__rate_interval` by its definition for `scrape_interval` (four scrape intervals).
fn dashboard_queries(scrape_interval: u64) -> anyhow::Result<Vec<PanelQuery>> {
    let path = monitoring_dir().join("dashboards").join("replicator.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let mut variables: Vec<(String, String)> = Vec::new();
    for var in dashboard["templating"]["list"].as_array().context("templating.list")? {
        let name = var["name"].as_str().context("variable name")?;
        if var["type"] == "datasource" {
            continue;
        }
        ensure!(
            var["includeAll"] == true,
            "variable {name}: only includeAll variables are substituted here: {var}"
        );
        let all = var["allValue"].as_str().context("allValue")?;
        variables.push((name.to_owned(), all.to_owned()));
    }
    // Longer names first, so `$a` never eats the start of `$ab`.
    variables.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
    let rate_interval = format!("{}s", 4 * scrape_interval);
    let mut queries = Vec::new();
    let mut panels: Vec<Value> = dashboard["panels"].as_array().context("panels")?.clone();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().cloned().unwrap_or_default());
        for target in panel["targets"].as_array().into_iter().flatten() {
            let mut expr = target["expr"].as_str().context("expr")?.to_owned();
            expr = expr.replace("$__rate_interval", &rate_interval);
            for (name, value) in &variables {
                expr = expr
                    .replace(&format!("${{{name}}}"), value)
                    .replace(&format!("${name}"), value);
            }
            ensure!(
                !expr.contains('$'),
                "{}: unsubstituted variable in {expr}",
                panel["title"]
            );
            queries.push(PanelQuery {
                title: panel["title"].as_str().unwrap_or_default().to_owned(),
                ref_id: target["refId"].as_str().unwrap_or_default().to_owned(),
                expr,
            });
        }
    }
    queries.reverse();
    Ok(queries)
}

/// The panels that must show data once the product has mirrored under churn (with one source
/// the hub refuses): lag, copies, writes and errors, cells up and the last sync.
const PANELS_WITH_DATA: [&str; 9] = [
    "Propagation lag p50 / p90 / p99 by location",
    "Propagation lag p99 by kind",
    "Copies on the hub per location",
    "Copies per location and kind",
    "Hub writes by op",
    "Errors by class",
    "Errors by location, kind and class",
    "Cells up",
    "Time since the last sync by kind",
];

#[tokio::test]
async fn prometheus_scrapes_the_deployed_product() -> TestResult {
    let env = Environment::ensure_up().await?;
    let _cells = deploy::exclusive(&env).await?;
    let image = image()?;
    let sites = [(CELL_A, "dfw"), (CELL_B, "sjc")];
    for (cell, _) in sites {
        deploy::require_free(&env, cell).await?;
    }
    let mut teardown = Teardown::new(&env, &["dfw", "sjc"]).await?;
    let hub = env.client(HUB).await?;

    // Deployed as the README says (and as deployed.rs's README scenario does).
    deploy::apply(&env, HUB, &deploy::config_dir("crds")).await?;
    deploy::apply_hub_rbac_for(&env, &mut teardown, &["dfw", "sjc"]).await?;
    let membership = deploy::write_overlay("monitoring-membership", Base::Membership, &image)?;
    teardown.path(&membership);
    teardown.applied(CELL_B, &membership);
    deploy::apply(&env, CELL_B, &membership).await?;
    let kubeconfig = membership.join("hub.kubeconfig");
    deploy::write_hub_kubeconfig(&env, deploy::MEMBERSHIP_SERVICE_ACCOUNT, &kubeconfig).await?;
    deploy::create_secret(&env, CELL_B, MEMBERSHIP_SECRET, &kubeconfig).await?;
    for (cell, location) in sites {
        deploy::apply(&env, cell, &deploy::config_dir("crds")).await?;
        let overlay = deploy::write_overlay(&format!("monitoring-{location}"), Base::Overlay(location), &image)?;
        teardown.path(&overlay);
        teardown.applied(cell, &overlay);
        deploy::apply(&env, cell, &overlay).await?;
        let kubeconfig = overlay.join("hub.kubeconfig");
        deploy::write_hub_kubeconfig(&env, &deploy::run_service_account(location), &kubeconfig).await?;
        deploy::create_secret(&env, cell, HUB_SECRET, &kubeconfig).await?;
    }
    let mut pods = Vec::new();
    for (cell, location) in sites {
        let client = env.client(cell).await?;
        let ready = deploy::wait_pods_ready(&client, CELL_SELECTOR, 2, PODS_READY).await?;
        let names: BTreeSet<String> = ready.iter().map(ResourceExt::name_any).collect();
        wait::until_observed(LEADER, &format!("a pod of {location} to lead"), || async {
            Ok::<_, replicator_e2e::Error>(match deploy::lease_holder(&hub, location).await? {
                Some(h) if names.contains(h.pod()) => Check::Ready(()),
                other => Check::NotYet(format!("holder {other:?}")),
            })
        })
        .await?;
        pods.extend(ready);
    }
    let cell_pods = pods.len();
    // config/hub runs two membership replicas, both scraped.
    pods.extend(deploy::wait_pods_ready(&env.client(CELL_B).await?, MEMBERSHIP_SELECTOR, 2, PODS_READY).await?);
    let targets = pods.len();

    // Prometheus, scraping what the ServiceMonitors select, with the alert rules loaded.
    let monitors = service_monitors()?;
    let scrape_interval = monitors
        .iter()
        .map(|m| seconds(&m.interval))
        .collect::<anyhow::Result<Vec<_>>>()?
        .into_iter()
        .max()
        .context("no interval")?;
    let prometheus = Prometheus::start(&env, &monitors, &rule_groups()?).await?;

    // Every product pod is a target, up; nothing else is.
    let up = wait::until_observed(TARGETS_UP, "every product pod scraped and up", || async {
        let up = prometheus.query("up").await?;
        let ones = up.iter().filter(|s| s["value"][1] == "1").count();
        Ok::<_, anyhow::Error>(if up.len() == targets && ones == targets {
            Check::Ready(up)
        } else {
            Check::NotYet(format!("{ones} of {} targets up, {targets} pods: {up:?}", up.len()))
        })
    })
    .await?;
    let scraped: BTreeSet<String> = up
        .iter()
        .filter_map(|s| s["metric"]["pod"].as_str().map(str::to_owned))
        .collect();
    let expected: BTreeSet<String> = pods.iter().map(ResourceExt::name_any).collect();
    assert_eq!(scraped, expected, "the targets are the product's pods");
    let jobs: BTreeSet<&str> = up.iter().filter_map(|s| s["metric"]["job"].as_str()).collect();
    assert_eq!(jobs, BTreeSet::from(["replicator", "replicator-membership"]), "{up:?}");

    // /metrics answers in the format asked for: OpenMetrics by default (and to what Prometheus
    // sends), Prometheus text 0.0.4 to `Accept: text/plain`; promtool check metrics (a text-format
    // linter) finds nothing on a live body of each kind of pod.
    let promtool = env.binaries().promtool.clone();
    for pod in [&pods[0], pods.last().context("pods")?] {
        let (content_type, openmetrics) = deploy::scrape_metrics_accepting(pod, None).await?;
        assert_eq!(
            content_type,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            "{}",
            pod.name_any()
        );
        assert!(openmetrics.ends_with("# EOF\n"), "{}: {openmetrics}", pod.name_any());
        let (content_type, text) =
            deploy::scrape_metrics_accepting(pod, Some("text/plain;version=0.0.4;q=0.9,*/*;q=0.1")).await?;
        assert_eq!(
            content_type,
            "text/plain; version=0.0.4; charset=utf-8",
            "{}",
            pod.name_any()
        );
        assert!(
            text.contains("\n# TYPE process_cpu_seconds_total counter\n") && !text.contains("# EOF"),
            "{}: {text}",
            pod.name_any()
        );
        let (status, out) = run(Command::new(&promtool).args(["check", "metrics"]), Some(&text)).await?;
        assert!(
            status.success() && out.trim().is_empty(),
            "promtool check metrics on {}'s /metrics: {status}\n{out}",
            pod.name_any()
        );
        eprintln!(
            "promtool check metrics on {} ({} lines of text format): clean",
            pod.name_any(),
            text.lines().count()
        );
    }

    // Churn in both cells, kept up while the queries run.
    let ns = unique("observed");
    for cluster in [HUB, CELL_A, CELL_B] {
        teardown.namespace(cluster, &ns);
    }
    deploy::routed_namespace(&env, &[HUB, CELL_A, CELL_B], &ns).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let ticks = Arc::new(AtomicUsize::new(0));
    let mut churns = Vec::new();
    for (cell, location) in sites {
        churns.push(tokio::spawn(churn(
            env.client(cell).await?,
            ns.clone(),
            location.to_owned(),
            Arc::clone(&stop),
            Arc::clone(&ticks),
        )));
    }
    let observed = async {
        wait::until(Duration::from_secs(60), "churn warm-up", || {
            let n = ticks.load(Ordering::Relaxed);
            async move { Ok::<_, String>((n >= 2 * CHURN_WARMUP).then_some(())) }
        })
        .await?;
        let lag_query =
            "histogram_quantile(0.99, sum by (le, location) (rate(replicator_propagation_lag_seconds_bucket[1m])))";
        let lag = wait::until_observed(OBSERVED, "a finite p99 lag for each location", || async {
            let lag = prometheus.by(lag_query, "location").await?;
            let finite = sites.iter().all(|(_, l)| lag.get(*l).is_some_and(|v| v.is_finite()));
            Ok::<_, anyhow::Error>(if finite {
                Check::Ready(lag)
            } else {
                Check::NotYet(format!("{lag:?}"))
            })
        })
        .await?;
        // Every panel's expression runs; those on lag, copies, writes and errors show data.
        let queries = dashboard_queries(scrape_interval)?;
        for title in PANELS_WITH_DATA {
            ensure!(
                queries.iter().any(|q| q.title == title),
                "the dashboard has no panel {title:?}"
            );
        }
        let empty = wait::until_observed(OBSERVED, "every dashboard panel with data", || async {
            let mut empty = Vec::new();
            for q in &queries {
                match prometheus.query(&q.expr).await {
                    Ok(result) if result.is_empty() => empty.push(format!("{}/{}", q.title, q.ref_id)),
                    Ok(_) => {}
                    Err(e) => return Ok::<_, anyhow::Error>(Check::Abort(format!("{}/{}: {e}", q.title, q.ref_id))),
                }
            }
            let missing: Vec<&String> = empty
                .iter()
                .filter(|e| PANELS_WITH_DATA.iter().any(|t| e.starts_with(&format!("{t}/"))))
                .collect();
            Ok(if missing.is_empty() {
                Check::Ready(empty.clone())
            } else {
                Check::NotYet(format!("no series for {missing:?}"))
            })
        })
        .await?;
        eprintln!(
            "dashboard: {} panel queries ran without error; without series now (nothing to show yet): {empty:?}",
            queries.len()
        );
        anyhow::Ok(lag)
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut writes = 0;
    for task in churns {
        writes += task.await??;
    }
    let lag = observed?;
    eprintln!("churn: {writes} writes in the cells");

    // Once the hub matches the cells, replicator_copies per location is the hub's count.
    let rules = convergence::default_rules(&["networkinterfaces", "endpointslices"])?;
    for (cell, location) in sites {
        let report =
            convergence::wait_converged(&env.client(cell).await?, &hub, &ns, location, &rules, CONVERGED).await?;
        eprintln!("{location}: {}", report.summary());
    }
    // Every replica (leader and standby) reports the hub's copies it caches: each one's
    // replicator_copies, summed per location, is the hub's count, and so is the dashboard's panel.
    let panel = dashboard_queries(scrape_interval)?
        .into_iter()
        .find(|q| q.title == "Copies on the hub per location")
        .context("the copies panel")?;
    let copies = wait::until_observed(OBSERVED, "replicator_copies to match the hub per location", || async {
        let mut on_hub = BTreeMap::new();
        for (_, location) in sites {
            on_hub.insert(location.to_owned(), hub_copies(&hub, location).await? as f64);
        }
        let per_pod = prometheus.query("sum by (location, pod) (replicator_copies)").await?;
        let pods_agree = per_pod.len() == cell_pods
            && per_pod.iter().all(|s| {
                let location = s["metric"]["location"].as_str().unwrap_or_default();
                s["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()) == on_hub.get(location).copied()
            });
        let dashboard = prometheus.by(&panel.expr, "location").await?;
        Ok::<_, anyhow::Error>(if pods_agree && dashboard == on_hub {
            Check::Ready(on_hub)
        } else {
            Check::NotYet(format!("per pod {per_pod:?}; dashboard {dashboard:?}; hub {on_hub:?}"))
        })
    })
    .await?;

    // The alert rules evaluate on the live data without error.
    let groups = prometheus.api("rules", &[]).await?;
    let mut evaluated = 0;
    for group in groups["groups"].as_array().context("groups")? {
        for rule in group["rules"].as_array().context("rules")? {
            assert_ne!(rule["health"], "err", "{}: {}", rule["name"], rule["lastError"]);
            evaluated += 1;
        }
    }
    assert_eq!(evaluated, alert_names(&rule_groups()?).len(), "{groups}");

    let final_up = prometheus.by("up", "pod").await?;
    let up_now = final_up.values().filter(|v| **v == 1.0).count();
    assert_eq!(up_now, targets, "{final_up:?}");
    let fmt = |m: &BTreeMap<String, f64>, unit: &str| {
        m.iter()
            .map(|(k, v)| {
                format!(
                    "{k}={}{unit}",
                    if unit.is_empty() {
                        format!("{v}")
                    } else {
                        format!("{v:.3}")
                    }
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "prometheus: p99 lag {}; copies {}; up {up_now}/{targets} targets",
        fmt(&lag, "s"),
        fmt(&copies, "")
    );
    prometheus.stop().await?;
    teardown.finish(&env).await?;
    Ok(())
}
