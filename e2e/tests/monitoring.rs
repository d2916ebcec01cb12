//! `config/monitoring` checked with the real Prometheus tools (issue "Observed as deployed"):
//!
//! - `promtool_checks_and_unit_tests_every_alert` (no environment): the PrometheusRule's `spec`
//!   written out as a plain rules file passes `promtool check rules`, and the unit tests of
//!   `config/monitoring/tests/` pass `promtool test rules`; every alert has a case where it fires
//!   and one where it stays quiet. Prints the number of cases.

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, anyhow, bail, ensure};
use replicator_e2e::binaries::{Binaries, PROMETHEUS_RELEASE};
use replicator_e2e::fixtures::unique;
use replicator_e2e::paths;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// The name the rule unit tests give the rules file (`rule_files:`), written next to them.
const RULES_FILE: &str = "prometheus_rule.rules.yaml";

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
