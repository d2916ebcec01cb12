//! The deployment manifests under `config/` (issue "Production readiness", part 1) against the
//! real local control plane:
//!
//! - every kustomization renders with the project's kubectl, and the hub or a cell accepts the
//!   result in a server-side dry run with strict field validation (a typo fails here);
//! - the rendered Deployments keep their contract (location per overlay, the hub kubeconfig
//!   Secret mounted without `optional`, probes, security context, metrics wiring);
//! - the ClusterRoles grant exactly the verbs the code uses: the rendered rules equal the tables
//!   below, and the apiserver's authorizer agrees verb by verb (SubjectAccessReview, and
//!   `kubectl auth can-i --as`), including that an apply which creates needs `create`;
//! - the real `replicator run` and `replicator membership`, started with the rendered container
//!   arguments and authenticated as the rendered service accounts (real tokens, no admin),
//!   mirror, withdraw, sweep, write status and slices, and publish Events without a single
//!   forbidden error;
//! - every `replicator_*` metric the alerts and the dashboard name is one the code registers;
//! - deployed for real as the README says (`kubectl apply --server-side -k`: `crds` to the hub
//!   and both cells, `overlays/dfw` to cell-a, `overlays/sjc` to cell-b, `rbac/hub`,
//!   `overlays/dfw/hub`, `overlays/sjc/hub`, `hub` and `monitoring` to the hub, plus the hub
//!   kubeconfig Secrets with real tokens of `replicator-dfw`, `replicator-sjc` and
//!   `replicator-membership`), every object is live as rendered; then it is all removed again
//!   (the CRDs excepted: the harness owns them).
//!
//! Everything but the real deployment lands in namespaces and under names of its own, so the
//! shared environment and concurrent scenarios are not disturbed; cluster-scoped objects are
//! removed at the end. The hub's service accounts keep their shipped names there too
//! (`replicator-<location>` with a location of the test's own, `replicator-membership`): the hub's
//! admission policies recognise an identity by its account name, and the processes this test
//! runs must pass them. The real deployment uses the shipped names (`replicator-system`,
//! `replicator-cell`, `replicator-location`, ...), which nothing else in the suite uses: the
//! harness's own cluster-scoped objects are suffixed `-e2e` (see `replicator_e2e::rbac`).

// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
    discovery::v1::EndpointSlice,
    events::v1::Event,
    rbac::v1::{ClusterRole, ClusterRoleBinding, RoleRef, Subject},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{
    Api,
    api::{ListParams, PostParams},
};
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, CELL_B, Cluster, Environment, HUB, ReplicatorProcess,
    fixtures::{self, CONVERGE, unique},
    metrics, paths,
    process::log_tail,
    rbac,
    replicator_process::http_get,
};
use serde_json::{Value, json};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Every kustomization under `config/` and the cluster its dry run goes to.
const KUSTOMIZATIONS: [(&str, Cluster); 11] = [
    ("cell", CELL_A),
    ("crds", HUB),
    ("hub", HUB),
    ("monitoring", HUB),
    ("overlays/dfw", CELL_A),
    ("overlays/dfw/hub", HUB),
    ("overlays/sjc", CELL_A),
    ("overlays/sjc/hub", HUB),
    ("rbac/cell", CELL_A),
    ("rbac/hub", HUB),
    ("rbac/hub/location", HUB),
];

const NET: &str = "networking.datumapis.com";
const DISCOVERY: &str = "discovery.k8s.io";
const EVENTS: &str = "events.k8s.io";

/// `(API group, resource[/subresource], verbs)`.
type Rules = &'static [(&'static str, &'static str, &'static [&'static str])];

/// `replicator run` in its cell: reflectors on the mirrored kinds and namespaces, the sweep's
/// confirming GET, Events on sources.
const CELL_RULES: Rules = &[
    (NET, "networks", &["get", "list", "watch"]),
    (NET, "networkcontexts", &["get", "list", "watch"]),
    (NET, "subnets", &["get", "list", "watch"]),
    (NET, "networkinterfaces", &["get", "list", "watch"]),
    (DISCOVERY, "endpointslices", &["get", "list", "watch"]),
    ("", "namespaces", &["list", "watch"]),
    (EVENTS, "events", &["create", "patch"]),
];

/// `replicator run` on the hub: copy reflectors, the name check and withdrawal GETs,
/// server-side apply (which needs `create` when it creates), status apply, deletes, the hub
/// namespace watch, and the Event of a location another cell claims.
const HUB_RULES: Rules = &[
    (NET, "networks", &["get", "list", "watch", "create", "patch", "delete"]),
    (
        NET,
        "networkcontexts",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    (NET, "subnets", &["get", "list", "watch", "create", "patch", "delete"]),
    (
        NET,
        "networkinterfaces",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    (NET, "networkinterfaces/status", &["patch"]),
    (
        DISCOVERY,
        "endpointslices",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    ("", "namespaces", &["list", "watch"]),
    (EVENTS, "events", &["create", "patch"]),
];

/// `replicator membership` on the hub.
const MEMBERSHIP_RULES: Rules = &[
    (NET, "networkinterfaces", &["list", "watch"]),
    (NET, "networkservices", &["list", "watch"]),
    (NET, "networkservices/status", &["patch"]),
    (
        DISCOVERY,
        "endpointslices",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    ("", "namespaces", &["list", "watch"]),
    (EVENTS, "events", &["create", "patch"]),
];

/// Resources the authorizer is asked about for every role: the ones the code touches and a few
/// it must never touch.
const PROBED: [(&str, &str); 17] = [
    (NET, "networks"),
    (NET, "networkcontexts"),
    (NET, "subnets"),
    (NET, "networkinterfaces"),
    (NET, "networkservices"),
    (NET, "networks/status"),
    (NET, "networkinterfaces/status"),
    (NET, "networkservices/status"),
    (DISCOVERY, "endpointslices"),
    ("", "namespaces"),
    (EVENTS, "events"),
    ("", "events"),
    ("", "secrets"),
    ("", "configmaps"),
    ("", "serviceaccounts"),
    ("coordination.k8s.io", "leases"),
    ("rbac.authorization.k8s.io", "clusterroles"),
];

const VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];

const FIELD_MANAGER: &str = "replicator-manifests-test";

fn config_dir() -> PathBuf {
    paths::workspace_root().join("config")
}

/// Directories under `config/` holding a kustomization (`kustomization.yaml`, or `.yml` as in
/// `config/crds/`, whose `*.yaml` files the harness installs as CRDs), relative to `config/`.
fn discovered_kustomizations() -> BTreeSet<String> {
    fn walk(dir: &Path, root: &Path, found: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, found);
            } else if path.file_name().is_some_and(|n| {
                ["kustomization.yaml", "kustomization.yml", "Kustomization"].contains(&&*n.to_string_lossy())
            }) && !std::fs::read_to_string(&path).unwrap().contains("\nkind: Component\n")
            {
                // A kustomize Component renders only composed onto a base: e2e/tests/kinds.rs
                // applies config/components/* that way.
                let rel = path.parent().unwrap().strip_prefix(root).unwrap();
                found.insert(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut found = BTreeSet::new();
    walk(&config_dir(), &config_dir(), &mut found);
    found
}

/// `kubectl kustomize <dir>` with the environment's kubectl.
async fn kustomize(env: &Environment, dir: &Path) -> String {
    env.kubectl_ok(HUB, [OsString::from("kustomize"), dir.as_os_str().to_owned()])
        .await
        .unwrap_or_else(|e| panic!("kubectl kustomize {} failed: {e}", dir.display()))
}

fn objects(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap()
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// The one object of `kind` named `name` (for a generated ConfigMap: `name-<hash>`).
fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let matches = |n: &str| {
        n == name
            || (kind == "ConfigMap"
                && n.strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|hash| hash.len() == 10 && hash.chars().all(|c| c.is_ascii_alphanumeric())))
    };
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"].as_str().is_some_and(matches))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} named {name}, found {}",
        found.len()
    );
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// A scratch directory of this test run (removed on drop).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("replicator-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
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

/// Renders `config/<target>` through an overlay moving it into namespace `ns` with every name
/// suffixed `-<suffix>` (kustomize keeps references consistent, binding subjects included: this
/// also proves an operator can re-namespace the manifests), optionally without its Namespace
/// objects. Returns the file holding the result and its objects.
async fn render_isolated(
    env: &Environment,
    scratch: &Scratch,
    target: &str,
    ns: &str,
    suffix: &str,
    drop_namespaces: bool,
) -> (PathBuf, Vec<Value>) {
    let yaml = rbac::render_wrapped(env, &scratch.0, target, ns, suffix, drop_namespaces)
        .await
        .unwrap_or_else(|e| panic!("rendering {target}: {e}"));
    let file = scratch.path(&format!("{}.yaml", target.replace('/', "-")));
    std::fs::write(&file, &yaml).unwrap();
    (file, objects(&yaml))
}

async fn apply_file(env: &Environment, cluster: Cluster, file: &Path, dry_run: bool) -> std::process::Output {
    let mut args: Vec<OsString> = [
        "apply",
        "--server-side",
        "--validate=strict",
        "--field-manager",
        FIELD_MANAGER,
    ]
    .map(OsString::from)
    .to_vec();
    if dry_run {
        args.push("--dry-run=server".into());
    }
    args.extend(["-f".into(), file.as_os_str().to_owned()]);
    env.kubectl(cluster, args).await.unwrap()
}

fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Installs the minimal monitoring.coreos.com CRDs of `e2e/testdata` on the hub.
async fn install_monitoring_crds(env: &Environment) {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/monitoring-crds.yaml");
    let out = apply_file(env, HUB, &file, false).await;
    assert!(
        out.status.success(),
        "installing {}: {}",
        file.display(),
        output_text(&out)
    );
    env.kubectl_ok(
        HUB,
        [
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/servicemonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com",
        ],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn every_kustomization_renders_and_passes_a_strict_server_side_dry_run() -> TestResult {
    let env = Environment::ensure_up().await?;
    let listed: BTreeSet<String> = KUSTOMIZATIONS.iter().map(|(d, _)| (*d).to_owned()).collect();
    assert_eq!(
        discovered_kustomizations(),
        listed,
        "every kustomization under config/ is rendered and dry-run here: add a new one to KUSTOMIZATIONS"
    );
    install_monitoring_crds(&env).await;
    let ns = unique("manifests");
    let suffix = ns.trim_start_matches("manifests-").to_owned();
    fixtures::namespace(&env, &[HUB, CELL_A], &ns, false).await?;
    let scratch = Scratch::new(&ns);

    for (dir, cluster) in KUSTOMIZATIONS {
        let pristine = objects(&kustomize(&env, &config_dir().join(dir)).await);
        assert!(!pristine.is_empty(), "{dir} renders nothing");
        for o in &pristine {
            assert!(
                o["apiVersion"].is_string() && o["kind"].is_string() && o["metadata"]["name"].is_string(),
                "{dir}: object without apiVersion, kind or name: {o}"
            );
        }
        // The CRDs are cluster-scoped and named by their group: dry-run them as they are. The
        // rest goes into this run's namespace under suffixed names.
        let (file, rendered) = if dir == "crds" {
            let file = scratch.path("crds.yaml");
            std::fs::write(&file, kustomize(&env, &config_dir().join(dir)).await)?;
            (file, pristine.clone())
        } else {
            render_isolated(&env, &scratch, dir, &ns, &suffix, false).await
        };
        assert_eq!(
            rendered.len(),
            pristine.len(),
            "{dir}: the isolated render lost objects"
        );
        let out = apply_file(&env, cluster, &file, true).await;
        let text = output_text(&out);
        assert!(out.status.success(), "{dir} rejected by {}:\n{text}", cluster.name());
        assert_eq!(
            text.matches("(server dry run)").count(),
            rendered.len(),
            "{dir}: not every object was accepted:\n{text}"
        );
        eprintln!(
            "{dir}: {} objects accepted by {} (dry run)",
            rendered.len(),
            cluster.name()
        );
    }

    // The dry run is strict: a misspelt field is an error, not silently dropped.
    let (file, _) = render_isolated(&env, &scratch, "overlays/dfw", &ns, &suffix, false).await;
    let typo = std::fs::read_to_string(&file)?.replacen("readinessProbe:", "readinesProbe:", 1);
    let typo_file = scratch.path("typo.yaml");
    std::fs::write(&typo_file, typo)?;
    let out = apply_file(&env, CELL_A, &typo_file, true).await;
    assert!(
        !out.status.success() && output_text(&out).contains("readinesProbe"),
        "a misspelt field must fail the dry run: {}",
        output_text(&out)
    );
    Ok(())
}

fn env_value<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .and_then(|e| e.iter().find(|v| v["name"] == name))
        .unwrap_or(&Value::Null)
}

fn arg_value(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(str::to_owned))
}

fn port_number(container: &Value, name: &str) -> Option<u64> {
    container["ports"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
}

/// The contract shared by both Deployments: the hub kubeconfig Secret mounted without
/// `optional`, metrics on 8080, probes on 8081, JSON logs, non-root, read-only, no capabilities,
/// resources set. Returns the container.
fn check_deployment<'a>(deployment: &'a Value, subcommand: &str) -> &'a Value {
    let name = deployment["metadata"]["name"].as_str().unwrap();
    let spec = &deployment["spec"];
    // Leader election on a hub Lease (both commands): a warm standby, and a rollout that never
    // drops to zero.
    assert_eq!(spec["replicas"], 2, "{name}: leader and standby");
    assert_eq!(spec["strategy"]["type"], "RollingUpdate", "{name}");
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0, "{name}");
    let pod = &spec["template"]["spec"];
    let selector = spec["selector"]["matchLabels"].as_object().unwrap();
    for (k, v) in selector {
        assert_eq!(
            &spec["template"]["metadata"]["labels"][k], v,
            "{name}: selector matches the pod"
        );
    }
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "{name}: one container");
    let c = &containers[0];
    assert_eq!(c["image"], "ghcr.io/datum-cloud/replicator:latest");
    let args = strings(&c["args"]);
    assert_eq!(args.first().map(String::as_str), Some(subcommand), "{name}: {args:?}");
    assert_eq!(arg_value(&args, "--log-format").as_deref(), Some("json"));
    assert_eq!(
        arg_value(&args, "--metrics-bind-address").as_deref(),
        Some("0.0.0.0:8080")
    );
    assert_eq!(
        arg_value(&args, "--health-probe-bind-address").as_deref(),
        Some("0.0.0.0:8081")
    );
    assert_eq!(port_number(c, "metrics"), Some(8080));
    assert_eq!(port_number(c, "probes"), Some(8081));
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "probes");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "probes");

    // The hub kubeconfig: Secret karmada-hub-kubeconfig (membership's: karmada-hub-kubeconfig-
    // membership, so that both can share a namespace), key kubeconfig, at the path the flag names,
    // and not optional, so the pod waits for the Secret (seed 000).
    let secret_name = if subcommand == "membership" {
        "karmada-hub-kubeconfig-membership"
    } else {
        "karmada-hub-kubeconfig"
    };
    let hub_kubeconfig = arg_value(&args, "--hub-kubeconfig").expect("--hub-kubeconfig");
    assert_eq!(hub_kubeconfig, "/etc/karmada-hub/kubeconfig");
    let volumes = pod["volumes"].as_array().unwrap();
    let volume = volumes
        .iter()
        .find(|v| v["secret"]["secretName"] == secret_name)
        .unwrap_or_else(|| panic!("{name}: no volume of Secret {secret_name}"));
    assert!(
        volume["secret"].get("optional").is_none(),
        "{name}: the hub kubeconfig Secret must not be optional: {volume}"
    );
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .unwrap_or_else(|| panic!("{name}: the hub kubeconfig volume is not mounted"));
    assert_eq!(mount["readOnly"], true);
    let item = &volume["secret"]["items"][0];
    assert_eq!(item["key"], "kubeconfig");
    assert_eq!(
        format!(
            "{}/{}",
            mount["mountPath"].as_str().unwrap(),
            item["path"].as_str().unwrap()
        ),
        hub_kubeconfig,
        "{name}: the flag names the mounted file"
    );

    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    for path in [["requests", "cpu"], ["requests", "memory"], ["limits", "memory"]] {
        assert!(
            c["resources"][path[0]][path[1]].is_string(),
            "{name}: resources.{path:?}"
        );
    }
    c
}

/// The metrics Service of a Deployment selects its pods and serves port `metrics`.
fn check_metrics_service(service: &Value, deployment: &Value) {
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "the Service selects the pods");
    }
    let port = &service["spec"]["ports"][0];
    assert_eq!(port["name"], "metrics");
    assert_eq!(port["port"], 8080);
    assert_eq!(port["targetPort"], "metrics");
}

/// `(group, resource, verb)` triples of a rule table.
fn triples(rules: Rules) -> BTreeSet<(String, String, String)> {
    rules
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(|v| ((*g).to_owned(), (*r).to_owned(), (*v).to_owned()))
        })
        .collect()
}

/// `(group, resource, verb)` triples a rendered ClusterRole grants (no wildcards allowed).
fn granted(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    assert!(g != "*" && r != "*" && v != "*", "wildcard in {rule}");
                    out.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    assert!(role.get("aggregationRule").is_none());
    out
}

/// The ClusterRoleBinding of `role` binds it to ServiceAccount `sa` of namespace `ns`.
fn check_binding(objects: &[Value], role: &str, sa: &str, ns: &str) {
    let binding = find(objects, "ClusterRoleBinding", role);
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(
        binding["roleRef"]["name"],
        find(objects, "ClusterRole", role)["metadata"]["name"]
    );
    let sa_obj = find(objects, "ServiceAccount", sa);
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": sa_obj["metadata"]["name"], "namespace": ns}]),
        "{role} binds {sa}"
    );
}

#[tokio::test]
async fn rendered_manifests_keep_the_deployment_contract() -> TestResult {
    let env = Environment::ensure_up().await?;
    let render = |dir: &'static str| {
        let env = &env;
        async move { objects(&kustomize(env, &config_dir().join(dir)).await) }
    };

    for location in ["dfw", "sjc"] {
        let o = render(if location == "dfw" {
            "overlays/dfw"
        } else {
            "overlays/sjc"
        })
        .await;
        for obj in o
            .iter()
            .filter(|o| o["kind"] != "Namespace" && !o["kind"].as_str().unwrap().starts_with("Cluster"))
        {
            assert_eq!(obj["metadata"]["namespace"], "replicator-system", "{obj}");
        }
        let deployment = find(&o, "Deployment", "replicator");
        let c = check_deployment(deployment, "run");
        let args = strings(&c["args"]);
        // The location comes from the overlay's ConfigMap through $(REPLICATOR_LOCATION).
        assert_eq!(
            arg_value(&args, "--location").as_deref(),
            Some("$(REPLICATOR_LOCATION)")
        );
        assert!(
            arg_value(&args, "--cell-kubeconfig").is_none(),
            "the cell is the in-cluster account"
        );
        let from = &env_value(c, "REPLICATOR_LOCATION")["valueFrom"]["configMapKeyRef"];
        let cm = find(&o, "ConfigMap", "replicator-location");
        assert_eq!(
            from["name"], cm["metadata"]["name"],
            "the env names the generated ConfigMap"
        );
        assert_eq!(
            cm["data"][from["key"].as_str().unwrap()],
            location,
            "{location} overlay"
        );
        let pod = &deployment["spec"]["template"]["spec"];
        assert_ne!(
            pod["automountServiceAccountToken"], false,
            "the cell client needs its token"
        );
        let sa = find(&o, "ServiceAccount", "replicator");
        assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
        check_binding(&o, "replicator-cell", "replicator", "replicator-system");
        assert_eq!(granted(find(&o, "ClusterRole", "replicator-cell")), triples(CELL_RULES));
        check_metrics_service(find(&o, "Service", "replicator"), deployment);
    }
    // The base alone carries no location, so it cannot start under a wrong one.
    let base = render("cell").await;
    assert_eq!(find(&base, "ConfigMap", "replicator-location")["data"]["location"], "");

    let hub = render("hub").await;
    let deployment = find(&hub, "Deployment", "replicator-membership");
    let c = check_deployment(deployment, "membership");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["automountServiceAccountToken"], false,
        "membership talks to the hub through its kubeconfig only"
    );
    // The Lease identity is the pod name, from the downward API; the Lease is the default one.
    assert_eq!(
        env_value(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    let args = strings(&c["args"]);
    for flag in ["--identity", "--leader-elect", "--lease-name", "--lease-namespace"] {
        assert!(arg_value(&args, flag).is_none(), "{flag}: the defaults apply");
    }
    // A drain keeps one replica: the PodDisruptionBudget selects exactly the Deployment's pods.
    let pdb = find(&hub, "PodDisruptionBudget", "replicator-membership");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
        "the budget covers the membership pods"
    );
    check_metrics_service(find(&hub, "Service", "replicator-membership"), deployment);

    let rbac = render("rbac/hub").await;
    assert_eq!(
        granted(find(&rbac, "ClusterRole", "replicator-hub")),
        triples(HUB_RULES)
    );
    assert_eq!(
        granted(find(&rbac, "ClusterRole", "replicator-membership")),
        triples(MEMBERSHIP_RULES)
    );
    // `replicator run` has no shared hub account: each location's overlay binds the roles.
    assert!(
        !rbac
            .iter()
            .any(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == "replicator"),
        "no shared hub account replicator"
    );
    assert!(
        !rbac
            .iter()
            .any(|o| o["kind"].as_str().is_some_and(|k| k.ends_with("Binding"))
                && matches!(
                    o["roleRef"]["name"].as_str(),
                    Some("replicator-hub" | "replicator-lease")
                )),
        "config/rbac/hub binds replicator run's roles to nobody"
    );
    check_binding(
        &rbac,
        "replicator-membership",
        "replicator-membership",
        "replicator-system",
    );
    // A location's Lease: the namespaced Role every location's identity is bound to.
    assert_eq!(
        find(&rbac, "Role", "replicator-lease")["rules"],
        json!([{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "verbs": ["get", "list", "watch", "create", "patch"]}])
    );
    // Each location's identity (config/overlays/<location>/hub, on config/rbac/hub/location):
    // replicator-<location> of replicator-system bound to both roles, and nothing else.
    for location in ["dfw", "sjc"] {
        let o = render(if location == "dfw" {
            "overlays/dfw/hub"
        } else {
            "overlays/sjc/hub"
        })
        .await;
        let account = format!("replicator-{location}");
        let made: BTreeSet<(String, String)> = o
            .iter()
            .map(|o| {
                (
                    o["kind"].as_str().unwrap().to_owned(),
                    o["metadata"]["name"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(
            made,
            BTreeSet::from([
                ("ServiceAccount".to_owned(), account.clone()),
                ("ClusterRoleBinding".to_owned(), format!("replicator-hub-{location}")),
                ("RoleBinding".to_owned(), format!("replicator-lease-{location}")),
            ]),
            "{location}: the identity and its two bindings"
        );
        let subject = json!([{"kind": "ServiceAccount", "name": account, "namespace": "replicator-system"}]);
        assert_eq!(
            find(&o, "ServiceAccount", &account)["metadata"]["namespace"],
            "replicator-system"
        );
        for (binding, role_kind, role) in [
            (format!("replicator-hub-{location}"), "ClusterRole", "replicator-hub"),
            (format!("replicator-lease-{location}"), "Role", "replicator-lease"),
        ] {
            let kind = if role_kind == "ClusterRole" {
                "ClusterRoleBinding"
            } else {
                "RoleBinding"
            };
            let b = find(&o, kind, &binding);
            assert_eq!(
                b["roleRef"],
                json!({"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role}),
                "{binding}"
            );
            // The role it names is the one config/rbac/hub ships.
            find(&rbac, role_kind, role);
            assert_eq!(b["subjects"], subject, "{binding}");
            if kind == "RoleBinding" {
                assert_eq!(b["metadata"]["namespace"], "replicator-system", "{binding}");
            }
        }
    }
    // The admission policies: both bound, denying, failing closed.
    for policy in ["replicator-location", "replicator-membership"] {
        let vap = find(&rbac, "ValidatingAdmissionPolicy", policy);
        assert_eq!(vap["spec"]["failurePolicy"], "Fail", "{policy}");
        let binding = find(&rbac, "ValidatingAdmissionPolicyBinding", policy);
        assert_eq!(binding["spec"]["policyName"], vap["metadata"]["name"], "{policy}");
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]), "{policy}");
    }
    // Membership's Lease: a namespaced Role of its own, bound to its account only.
    let lease_role = find(&rbac, "Role", "replicator-membership-lease");
    assert_eq!(
        lease_role["rules"],
        json!([{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "verbs": ["get", "list", "watch", "create", "patch"]}])
    );
    let lease_binding = find(&rbac, "RoleBinding", "replicator-membership-lease");
    assert_eq!(
        lease_binding["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "replicator-membership-lease"})
    );
    assert_eq!(
        lease_binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "replicator-membership", "namespace": "replicator-system"}])
    );

    // Monitoring: each ServiceMonitor selects the metrics Service of one Deployment.
    let monitoring = render("monitoring").await;
    let cell = render("overlays/dfw").await;
    for (monitor, service) in [
        (
            find(&monitoring, "ServiceMonitor", "replicator"),
            find(&cell, "Service", "replicator"),
        ),
        (
            find(&monitoring, "ServiceMonitor", "replicator-membership"),
            find(&hub, "Service", "replicator-membership"),
        ),
    ] {
        let labels = &service["metadata"]["labels"];
        for (k, v) in monitor["spec"]["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(
                &labels[k], v,
                "{} selects {}",
                monitor["metadata"]["name"], service["metadata"]["name"]
            );
        }
        assert!(strings(&monitor["spec"]["namespaceSelector"]["matchNames"]).contains(&"replicator-system".to_owned()));
        assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    }
    let rule = find(&monitoring, "PrometheusRule", "replicator");
    let alerts: BTreeMap<String, String> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_owned(),
                r["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (alert, needle) in [
        (
            "ReplicatorPropagationLagHigh",
            "replicator_propagation_lag_seconds_bucket",
        ),
        ("ReplicatorHubUnreachable", "replicator_hub_up"),
        (
            "ReplicatorSweepDeletingMany",
            "increase(replicator_sweep_deleted_total[",
        ),
        ("ReplicatorNoLeader", "sum by (location) (replicator_leader) == 0"),
    ] {
        let expr = alerts
            .get(alert)
            .unwrap_or_else(|| panic!("alert {alert} missing: {alerts:?}"));
        assert!(expr.contains(needle), "{alert}: {expr}");
    }
    let dashboard = find(&monitoring, "ConfigMap", "replicator-dashboard");
    let json: Value = serde_json::from_str(dashboard["data"]["replicator.json"].as_str().unwrap())?;
    let exprs: Vec<String> = json["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_owned())
        .collect();
    for needle in [
        "histogram_quantile(0.99, sum by (location, le) (rate(replicator_propagation_lag_seconds_bucket",
        "sum by (location) (max by (location, kind) (replicator_copies",
        "sum by (class) (rate(replicator_errors_total",
        "sum by (verb, resource) (rate(replicator_api_requests_total{cluster=\"hub\"}",
        "min by (location) (replicator_cell_up",
        "increase(replicator_withdrawn_total",
        "replicator_last_sync_timestamp_seconds",
        "increase(replicator_sweep_runs_total",
        "increase(replicator_sweep_deleted_total",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(needle)),
            "dashboard lacks {needle}: {exprs:#?}"
        );
    }

    // Every replicator_* name the alerts and the dashboard use is one the code registers.
    let registered = registered_names();
    for file in ["prometheus_rule.yaml", "dashboards/replicator.json"] {
        let text = std::fs::read_to_string(config_dir().join("monitoring").join(file))?;
        let unknown: Vec<_> = referenced_names(&text).difference(&registered).cloned().collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the code does not register: {unknown:?}\nregistered: {registered:?}"
        );
    }
    Ok(())
}

/// The identity of a service account, as the apiserver authenticates its tokens.
fn service_account_user(ns: &str, name: &str) -> (String, Vec<String>) {
    (
        format!("system:serviceaccount:{ns}:{name}"),
        vec![
            "system:serviceaccounts".to_owned(),
            format!("system:serviceaccounts:{ns}"),
            "system:authenticated".to_owned(),
        ],
    )
}

/// Asks the authorizer of `cluster`, for every probed resource and verb, whether the service
/// account may; compares with `rules`.
async fn check_authorizer(env: &Environment, cluster: Cluster, ns: &str, sa: &str, rules: Rules) {
    let api = Api::<SubjectAccessReview>::all(env.client(cluster).await.unwrap());
    let expected = triples(rules);
    let (user, groups) = service_account_user(ns, sa);
    let mut wrong = Vec::new();
    for (group, resource) in PROBED {
        let (resource_name, subresource) = match resource.split_once('/') {
            Some((r, s)) => (r, Some(s.to_owned())),
            None => (resource, None),
        };
        for verb in VERBS {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.clone()),
                    groups: Some(groups.clone()),
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(group.to_owned()),
                        resource: Some(resource_name.to_owned()),
                        subresource: subresource.clone(),
                        verb: Some(verb.to_owned()),
                        ..ResourceAttributes::default()
                    }),
                    ..SubjectAccessReviewSpec::default()
                },
                ..SubjectAccessReview::default()
            };
            let allowed = api
                .create(&PostParams::default(), &review)
                .await
                .unwrap()
                .status
                .is_some_and(|s| s.allowed);
            let want = expected.contains(&(group.to_owned(), resource.to_owned(), verb.to_owned()));
            if allowed != want {
                wrong.push(format!("{verb} {group}/{resource}: allowed={allowed}, expected {want}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{user} on {}:\n{}", cluster.name(), wrong.join("\n"));
}

/// `kubectl auth can-i <args> --as=<service account>` on `cluster`: "yes" or "no".
async fn can_i(env: &Environment, cluster: Cluster, ns: &str, sa: &str, args: &[&str]) -> String {
    let mut all: Vec<String> = vec!["auth".into(), "can-i".into()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    all.push(format!("--as=system:serviceaccount:{ns}:{sa}"));
    let out = env.kubectl(cluster, &all).await.unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Deletes what a test made cluster-wide when it is dropped, whether the test passed or panicked
/// (`kubectl delete --ignore-not-found`, blocking: drop cannot await).
struct Cleanup {
    kubectl: PathBuf,
    items: Vec<(PathBuf, Vec<OsString>)>,
}

impl Cleanup {
    fn new(env: &Environment) -> Cleanup {
        Cleanup {
            kubectl: env.binaries().kubectl.clone(),
            items: Vec::new(),
        }
    }

    /// Deletes `what` (e.g. `-f file`, or `clusterrole name`) from `cluster` on drop.
    fn add(&mut self, env: &Environment, cluster: Cluster, what: &[&std::ffi::OsStr]) {
        let what = what.iter().map(|w| (*w).to_owned()).collect();
        self.items.push((env.kubeconfig_path(cluster), what));
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (kubeconfig, what) in self.items.iter().rev() {
            let _ = std::process::Command::new(&self.kubectl)
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(["delete", "--ignore-not-found", "--wait=false"])
                .args(what)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The RBAC of `config/rbac/{cell,hub}` applied for real, in namespace `ns`: the cell's with
/// every name suffixed; the hub's as the harness renders it (`replicator_e2e::rbac::render_hub`:
/// cluster-scoped names suffixed, the service accounts as shipped) plus the identity of a
/// location of the test's own (`config/rbac/hub/location` with `nameSuffix: -<location>`,
/// account `replicator-<location>`), so that the hub's admission policies take the accounts for
/// what they are.
struct AppliedRbac {
    suffix: String,
    location: String,
    cell: Vec<Value>,
    hub: Vec<Value>,
}

impl AppliedRbac {
    /// Applies both; `cleanup` deletes them again.
    async fn apply(
        env: &Environment,
        scratch: &Scratch,
        ns: &str,
        suffix: &str,
        location: &str,
        cleanup: &mut Cleanup,
    ) -> AppliedRbac {
        let (cell_file, cell) = render_isolated(env, scratch, "rbac/cell", ns, suffix, true).await;
        let hub_yaml = rbac::render_hub(env, &scratch.0, ns, suffix)
            .await
            .unwrap_or_else(|e| panic!("rendering rbac/hub: {e}"));
        let mut hub = objects(&hub_yaml);
        let identity = rbac::render_location_identity(env, &scratch.0, location, ns, suffix)
            .await
            .unwrap_or_else(|e| panic!("rendering rbac/hub/location for {location}: {e}"));
        hub.extend(identity);
        let hub_file = scratch.path("rbac-hub.json");
        std::fs::write(
            &hub_file,
            json!({"apiVersion": "v1", "kind": "List", "items": hub}).to_string(),
        )
        .unwrap();
        for (cluster, file) in [(CELL_A, &cell_file), (HUB, &hub_file)] {
            // Cluster-scoped objects outlive the namespace: remember them before they exist.
            cleanup.add(env, cluster, &["-f".as_ref(), file.as_os_str()]);
            let out = apply_file(env, cluster, file, false).await;
            assert!(
                out.status.success(),
                "applying {}: {}",
                file.display(),
                output_text(&out)
            );
        }
        AppliedRbac {
            suffix: suffix.to_owned(),
            location: location.to_owned(),
            cell,
            hub,
        }
    }

    /// The cell account of `replicator run` (`replicator-<suffix>`).
    fn cell_sa(&self) -> String {
        let name = format!("replicator-{}", self.suffix);
        find(&self.cell, "ServiceAccount", &name);
        name
    }

    /// The hub account of `replicator run` (`replicator-<location>`).
    fn hub_sa(&self) -> String {
        let name = rbac::hub_service_account(&self.location);
        find(&self.hub, "ServiceAccount", &name);
        name
    }

    /// The hub account of `replicator membership`, as shipped.
    fn membership_sa(&self) -> String {
        find(&self.hub, "ServiceAccount", "replicator-membership");
        "replicator-membership".to_owned()
    }
}

#[tokio::test]
async fn the_roles_grant_exactly_the_verbs_the_code_uses() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("rbac");
    let suffix = ns.trim_start_matches("rbac-").to_owned();
    let location = format!("loc{suffix}");
    fixtures::namespace(&env, &[HUB, CELL_A], &ns, false).await?;
    let scratch = Scratch::new(&ns);
    // Declared after `scratch`, so dropped (and run) before its files are removed.
    let mut cleanup = Cleanup::new(&env);
    let rbac = AppliedRbac::apply(&env, &scratch, &ns, &suffix, &location, &mut cleanup).await;
    let (cell_sa, hub_sa, membership_sa) = (rbac.cell_sa(), rbac.hub_sa(), rbac.membership_sa());

    // Verb by verb, as the apiserver's authorizer decides.
    check_authorizer(&env, CELL_A, &ns, &cell_sa, CELL_RULES).await;
    check_authorizer(&env, HUB, &ns, &hub_sa, HUB_RULES).await;
    check_authorizer(&env, HUB, &ns, &membership_sa, MEMBERSHIP_RULES).await;

    // The same through `kubectl auth can-i --as`, as an operator would ask.
    let n = ns.as_str();
    for (cluster, sa, args, answer) in [
        (
            CELL_A,
            &cell_sa,
            vec!["watch", "networkinterfaces.networking.datumapis.com", "-A"],
            "yes",
        ),
        (
            CELL_A,
            &cell_sa,
            vec!["get", "endpointslices.discovery.k8s.io", "-n", n],
            "yes",
        ),
        (CELL_A, &cell_sa, vec!["create", "events.events.k8s.io", "-n", n], "yes"),
        (CELL_A, &cell_sa, vec!["delete", "namespaces"], "no"),
        (
            CELL_A,
            &cell_sa,
            vec!["patch", "networkinterfaces.networking.datumapis.com", "-n", n],
            "no",
        ),
        (CELL_A, &cell_sa, vec!["get", "secrets", "-n", n], "no"),
        (
            HUB,
            &hub_sa,
            vec![
                "patch",
                "networkinterfaces.networking.datumapis.com",
                "--subresource=status",
                "-n",
                n,
            ],
            "yes",
        ),
        (
            HUB,
            &hub_sa,
            vec!["delete", "endpointslices.discovery.k8s.io", "-n", n],
            "yes",
        ),
        (HUB, &hub_sa, vec!["delete", "namespaces"], "no"),
        (HUB, &hub_sa, vec!["create", "namespaces"], "no"),
        // Leader election: the Lease Role of the namespace, nothing beyond it.
        (
            HUB,
            &hub_sa,
            vec!["patch", "leases.coordination.k8s.io", "-n", n],
            "yes",
        ),
        (
            HUB,
            &hub_sa,
            vec!["watch", "leases.coordination.k8s.io", "-n", n],
            "yes",
        ),
        (
            HUB,
            &hub_sa,
            vec!["delete", "leases.coordination.k8s.io", "-n", n],
            "no",
        ),
        (
            HUB,
            &hub_sa,
            vec!["patch", "leases.coordination.k8s.io", "-n", "kube-system"],
            "no",
        ),
        (
            HUB,
            &hub_sa,
            vec!["update", "networks.networking.datumapis.com", "-n", n],
            "no",
        ),
        (
            HUB,
            &membership_sa,
            vec![
                "patch",
                "networkservices.networking.datumapis.com",
                "--subresource=status",
                "-n",
                n,
            ],
            "yes",
        ),
        (
            HUB,
            &membership_sa,
            vec!["patch", "networkservices.networking.datumapis.com", "-n", n],
            "no",
        ),
        (HUB, &membership_sa, vec!["delete", "namespaces"], "no"),
        // Membership's leader election: its Lease Role in the namespace, nothing beyond it.
        (
            HUB,
            &membership_sa,
            vec!["create", "leases.coordination.k8s.io", "-n", n],
            "yes",
        ),
        (
            HUB,
            &membership_sa,
            vec!["patch", "leases.coordination.k8s.io", "-n", n],
            "yes",
        ),
        (
            HUB,
            &membership_sa,
            vec!["watch", "leases.coordination.k8s.io", "-n", n],
            "yes",
        ),
        (
            HUB,
            &membership_sa,
            vec!["delete", "leases.coordination.k8s.io", "-n", n],
            "no",
        ),
        (
            HUB,
            &membership_sa,
            vec!["patch", "leases.coordination.k8s.io", "-n", "kube-system"],
            "no",
        ),
    ] {
        assert_eq!(
            can_i(&env, cluster, &ns, sa, &args).await,
            answer,
            "can-i {args:?} as {sa} on {}",
            cluster.name()
        );
    }

    // Why the hub roles carry `create`: kube-apiserver authorizes a server-side apply that
    // creates the object as `create` too; one that updates needs `patch` only. Proven with the
    // rendered hub role minus `create`, bound to a service account of its own.
    let hub = env.client(HUB).await?;
    let rendered = find(&rbac.hub, "ClusterRole", &format!("replicator-hub-{suffix}"));
    let mut role: ClusterRole = serde_json::from_value(rendered.clone())?;
    let ablated = format!("{}-nocreate", role.metadata.name.clone().unwrap());
    role.metadata = ObjectMeta {
        name: Some(ablated.clone()),
        ..Default::default()
    };
    for rule in role.rules.iter_mut().flatten() {
        rule.verbs.retain(|v| v != "create");
    }
    let roles = Api::<ClusterRole>::all(hub.clone());
    let bindings = Api::<ClusterRoleBinding>::all(hub.clone());
    cleanup.add(&env, HUB, &["clusterrole".as_ref(), ablated.as_ref()]);
    cleanup.add(&env, HUB, &["clusterrolebinding".as_ref(), ablated.as_ref()]);
    roles.create(&PostParams::default(), &role).await?;
    env.kubectl_ok(HUB, ["-n", n, "create", "serviceaccount", "nocreate"])
        .await?;
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(ablated.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: ablated.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "nocreate".into(),
            namespace: Some(ns.clone()),
            ..Subject::default()
        }]),
    };
    bindings.create(&PostParams::default(), &binding).await?;
    // A copy as the location's identity writes one (the hub's admission policy lets
    // replicator-<location> write nothing else).
    let network = scratch.path("network.yaml");
    std::fs::write(
        &network,
        serde_json::to_string(&json!({"apiVersion": format!("{NET}/v1alpha"), "kind": "Network",
            "metadata": {"name": format!("applied-{location}"), "namespace": ns,
                         "labels": {replicator::rules::LOCATION_LABEL: location}},
            "spec": {"mtu": 1460}}))?,
    )?;
    let apply_as = |sa: String| {
        let (env, network, ns) = (&env, &network, &ns);
        async move {
            let out = env
                .kubectl(
                    HUB,
                    [
                        OsString::from("apply"),
                        "--server-side".into(),
                        "--field-manager=replicator-test".into(),
                        format!("--as=system:serviceaccount:{ns}:{sa}").into(),
                        "-f".into(),
                        network.as_os_str().to_owned(),
                    ],
                )
                .await
                .unwrap();
            (out.status.success(), output_text(&out))
        }
    };
    // RBAC changes reach the authorizer through an informer: allow it a moment.
    let (ok, text) = replicator_e2e::wait::until_observed(CONVERGE, "the ablated role to be in force", || {
        let apply = apply_as("nocreate".to_owned());
        async move {
            let (ok, text) = apply.await;
            Ok::<_, String>(if !ok && text.contains("cannot create resource \"networks\"") {
                replicator_e2e::wait::Check::Ready((ok, text))
            } else {
                replicator_e2e::wait::Check::NotYet(text)
            })
        }
    })
    .await?;
    assert!(!ok, "{text}");
    let (ok, text) = apply_as(hub_sa.clone()).await;
    assert!(ok, "the rendered hub role creates through apply: {text}");
    let (ok, text) = apply_as("nocreate".to_owned()).await;
    assert!(ok, "updating through apply needs no create: {text}");

    Ok(())
}

/// A `replicator` process started by this test with the rendered container arguments as they
/// are (the harness's spawner builds its own command line; both authenticate with service
/// account tokens, here of accounts in this test's own namespace). Killed on drop.
struct Running {
    name: String,
    child: tokio::process::Child,
    metrics_url: String,
    readyz_url: String,
    log: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Running {
    /// Starts the binary with the rendered container `args`, localised: `$(REPLICATOR_LOCATION)`
    /// expanded, the hub kubeconfig and bind addresses pointed at this machine, `extra` appended.
    async fn start(
        env: &Environment,
        name: &str,
        rendered: &[String],
        location: &str,
        hub_kubeconfig: &Path,
        extra: &[String],
    ) -> Running {
        let binary = ReplicatorProcess::binary_path();
        assert!(
            binary.is_file(),
            "{} is missing: run `cargo build --workspace --bins` first",
            binary.display()
        );
        let (metrics_port, health_port) = (free_port(), free_port());
        let mut replaced = BTreeSet::new();
        let mut args: Vec<String> = rendered
            .iter()
            .map(|a| {
                let a = a.replace("$(REPLICATOR_LOCATION)", location);
                let (flag, _) = a.split_once('=').unwrap_or((&a, ""));
                let value = match flag {
                    "--hub-kubeconfig" => hub_kubeconfig.display().to_string(),
                    "--metrics-bind-address" => format!("127.0.0.1:{metrics_port}"),
                    "--health-probe-bind-address" => format!("127.0.0.1:{health_port}"),
                    _ => return a,
                };
                replaced.insert(flag.to_owned());
                format!("{flag}={value}")
            })
            .collect();
        assert_eq!(
            replaced.len(),
            3,
            "rendered args lack a flag this test localises: {rendered:?}"
        );
        args.extend(extra.iter().cloned());
        let log = env.logs_dir().join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = tokio::process::Command::new(&binary)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        eprintln!("started {name}: {} {}", binary.display(), args.join(" "));
        let mut running = Running {
            name: name.to_owned(),
            child,
            metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
            readyz_url: format!("http://127.0.0.1:{health_port}/readyz"),
            log,
        };
        running.wait_ready().await;
        running
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut last;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("{} exited ({status}):\n{}", self.name, log_tail(&self.log, 40));
            }
            match http_get(&self.readyz_url).await {
                Ok((200, _)) => return,
                Ok((code, body)) => last = format!("{code}: {body}"),
                Err(e) => last = e.to_string(),
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready: {last}\n{}",
                self.name,
                log_tail(&self.log, 40)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn metrics(&self) -> String {
        http_get(&self.metrics_url).await.unwrap().1
    }

    /// Fails if any error counter of class `forbidden` moved: the RBAC lacks something.
    async fn assert_never_forbidden(&self) {
        let text = self.metrics().await;
        let forbidden: Vec<_> = metrics::parse(&text)
            .into_iter()
            .filter(|s| s.name.ends_with("errors_total") && s.label("class") == Some("forbidden") && s.value > 0.0)
            .collect();
        assert!(
            forbidden.is_empty(),
            "{} was refused: {forbidden:?}\n{}",
            self.name,
            log_tail(&self.log, 40)
        );
        let log = std::fs::read_to_string(&self.log).unwrap();
        assert!(
            !log.contains("forbidden"),
            "{} logged a refusal:\n{}",
            self.name,
            log_tail(&self.log, 40)
        );
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// Metric sample names a `/metrics` exposition declares (`# TYPE`), with the suffixes their
/// samples carry.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        let name = name.to_owned();
        match kind {
            "counter" => {
                names.insert(format!("{}_total", name.trim_end_matches("_total")));
            }
            "histogram" => {
                names.insert(name.clone());
                for s in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{s}"));
                }
            }
            _ => {
                names.insert(name);
            }
        }
    }
    names
}

/// Every `replicator_*` metric name mentioned in `text`.
fn referenced_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("replicator_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The sample names of every metric `replicator run` and `replicator membership` register, read
/// off their own registries with one series in each family (an empty family is not exposed).
fn registered_names() -> BTreeSet<String> {
    use replicator::metrics::{ErrorLabels, KindLabels, LocationLabels, WriteLabels, WriteOp};
    let kind = KindLabels {
        kind: "Network".into(),
        location: "dfw".into(),
    };
    let location = LocationLabels { location: "dfw".into() };
    let mut registry = Default::default();
    let m = replicator::metrics::Metrics::register(&mut registry);
    for family in [&m.propagation_lag, &m.queue_wait, &m.sync_duration] {
        family.get_or_create(&kind).observe(0.1);
    }
    m.api_request_duration
        .get_or_create(&replicator::metrics::ApiLatencyLabels {
            cluster: "hub",
            verb: "patch",
        })
        .observe(0.01);
    for family in [&m.copies, &m.unroutable, &m.source_up] {
        family.get_or_create(&kind).set(1);
    }
    m.last_sync.get_or_create(&kind).set(1.0);
    m.sweep_deleted.get_or_create(&kind).inc();
    m.withdrawn.get_or_create(&kind).inc();
    m.cell_up.get_or_create(&location).set(1);
    m.location_conflict.get_or_create(&location).set(0);
    m.writes
        .get_or_create(&WriteLabels {
            kind: "Network".into(),
            location: "dfw".into(),
            op: WriteOp::create,
        })
        .inc();
    m.errors
        .get_or_create(&ErrorLabels {
            kind: "Network".into(),
            location: "dfw".into(),
            class: "transient",
        })
        .inc();
    m.sweep_runs.get_or_create(&location).inc();
    m.hub_up.get_or_create(&location).set(1);
    m.leader.get_or_create(&location).set(1);
    m.api_requests
        .get_or_create(&replicator::metrics::ApiRequestLabels {
            cluster: "hub",
            verb: "patch",
            resource: "networkinterfaces".into(),
            code: "200".into(),
        })
        .inc();
    let mut names = exported_names(&replicator::metrics::encode(&registry).unwrap());

    let mut registry = Default::default();
    let m = replicator::membership::Metrics::register(&mut registry);
    let service = replicator::membership::ServiceLabels {
        namespace: "ns".into(),
        service: "svc".into(),
    };
    m.members.get_or_create(&service).set(1);
    m.healthy.get_or_create(&service).set(1);
    m.errors
        .get_or_create(&replicator::membership::ClassLabels { class: "transient" })
        .inc();
    m.status_writes.inc();
    m.passes.inc();
    names.extend(exported_names(&replicator::metrics::encode(&registry).unwrap()));
    names
}

/// How long the real processes may take for what this test waits on. Each `replicator run`
/// mirrors every source in cell-a, what earlier scenarios left there included, and `replicator
/// membership` resolves every NetworkService on the hub: on a long-lived shared environment the
/// first pass can hold hundreds of keys ahead of this test's.
const FIRST_PASS: Duration = Duration::from_secs(120);

/// A kubeconfig for `cluster` authenticating with `token`.
async fn write_kubeconfig(env: &Environment, cluster: Cluster, token: &str, path: &Path) {
    rbac::write_token_kubeconfig(env, cluster, &env.server_url(cluster), token, path)
        .await
        .unwrap();
}

/// A token of service account `ns/sa` on `cluster` (TokenRequest).
async fn token(env: &Environment, cluster: Cluster, ns: &str, sa: &str) -> String {
    env.service_account_token(cluster, ns, sa, "2h").await.unwrap()
}

#[tokio::test]
async fn replicator_runs_with_the_rendered_arguments_and_only_the_rendered_rbac() -> TestResult {
    let env = Environment::ensure_up().await?;
    let ns = unique("asdeployed");
    let suffix = ns.trim_start_matches("asdeployed-").to_owned();
    let location = format!("loc{suffix}");
    let unrouted = format!("{ns}-unrouted");
    fixtures::namespace(&env, &[HUB, CELL_A], &ns, true).await?;
    fixtures::namespace(&env, &[CELL_A], &unrouted, false).await?;
    let scratch = Scratch::new(&ns);
    // Declared after `scratch`, so dropped (and run) before its files are removed.
    let mut cleanup = Cleanup::new(&env);
    let rbac = AppliedRbac::apply(&env, &scratch, &ns, &suffix, &location, &mut cleanup).await;
    // Leave nothing for later scenarios' replicators to mirror, and take this location's copies
    // (of every source it saw) off the hub.
    let kinds = "networks.networking.datumapis.com,networkcontexts.networking.datumapis.com,\
                 subnets.networking.datumapis.com,networkinterfaces.networking.datumapis.com,\
                 endpointslices.discovery.k8s.io";
    for namespace in [&ns, &unrouted] {
        cleanup.add(
            &env,
            CELL_A,
            &["-n".as_ref(), namespace.as_ref(), kinds.as_ref(), "--all".as_ref()],
        );
    }
    let selector = format!("replicator.datumapis.com/location={location}");
    cleanup.add(
        &env,
        HUB,
        &["-A".as_ref(), kinds.as_ref(), "-l".as_ref(), selector.as_ref()],
    );
    cleanup.add(
        &env,
        HUB,
        &[
            "-n".as_ref(),
            ns.as_ref(),
            "networkservices.networking.datumapis.com".as_ref(),
            "--all".as_ref(),
        ],
    );

    // Credentials: tokens of the rendered service accounts, nothing else.
    let cell_kc = scratch.path("cell.kubeconfig");
    let hub_kc = scratch.path("hub.kubeconfig");
    let membership_kc = scratch.path("membership.kubeconfig");
    let t = token(&env, CELL_A, &ns, &rbac.cell_sa()).await;
    write_kubeconfig(&env, CELL_A, &t, &cell_kc).await;
    let t = token(&env, HUB, &ns, &rbac.hub_sa()).await;
    write_kubeconfig(&env, HUB, &t, &hub_kc).await;
    let t = token(&env, HUB, &ns, &rbac.membership_sa()).await;
    write_kubeconfig(&env, HUB, &t, &membership_kc).await;

    let cell_objects = objects(&kustomize(&env, &config_dir().join("overlays/dfw")).await);
    let run_args =
        strings(&find(&cell_objects, "Deployment", "replicator")["spec"]["template"]["spec"]["containers"][0]["args"]);
    let hub_objects = objects(&kustomize(&env, &config_dir().join("hub")).await);
    let membership_args = strings(
        &find(&hub_objects, "Deployment", "replicator-membership")["spec"]["template"]["spec"]["containers"][0]["args"],
    );

    // Sources of every default kind, and two Networks for the two ways a copy is withdrawn.
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let r = |rule: &str| fixtures::resource(rule).unwrap();
    let (networks, contexts, subnets, interfaces, slices) = (
        r("networks"),
        r("networkcontexts"),
        r("subnets"),
        r("networkinterfaces"),
        r("endpointslices"),
    );
    fixtures::apply(&cell, &networks, &fixtures::network(&ns, "net")).await?;
    fixtures::apply(
        &cell,
        &contexts,
        &fixtures::network_context(&ns, "ctx", "net", &location),
    )
    .await?;
    fixtures::apply(&cell, &subnets, &fixtures::subnet(&ns, "sub", "net", "ctx", &location)).await?;
    fixtures::apply(
        &cell,
        &interfaces,
        &fixtures::network_interface(&ns, "web-0", "net", "web-0", "web", &location),
    )
    .await?;
    fixtures::set_status(&cell, &interfaces, &ns, "web-0", fixtures::bound_status(true)).await?;
    fixtures::apply(
        &cell,
        &slices,
        &fixtures::galactic_slice(&ns, "pod-0", json!([fixtures::pod_endpoint("fd20::10", "pod-0")]), None),
    )
    .await?;
    for name in ["deleted-live", "deleted-offline"] {
        fixtures::apply(&cell, &networks, &fixtures::network(&ns, name)).await?;
    }
    fixtures::apply(&cell, &networks, &fixtures::network(&unrouted, "lost")).await?;

    // The rendered Lease Role is isolated in `ns` too, so the Lease lives there.
    let cell_arg = vec![
        format!("--cell-kubeconfig={}", cell_kc.display()),
        format!("--lease-namespace={ns}"),
    ];
    let run = Running::start(
        &env,
        &format!("manifests-{ns}-run-1"),
        &run_args,
        &location,
        &hub_kc,
        &cell_arg,
    )
    .await;

    // Apply that creates (create + patch), the status apply (patch on /status).
    for (resource, name) in [
        (&networks, "net"),
        (&contexts, "ctx"),
        (&subnets, "sub"),
        (&slices, "pod-0"),
        (&networks, "deleted-live"),
        (&networks, "deleted-offline"),
    ] {
        fixtures::wait_for(
            &hub,
            resource,
            &ns,
            &copy_name(&ns, name, &location),
            FIRST_PASS,
            "copy",
            |_| true,
        )
        .await?;
    }
    fixtures::wait_for(
        &hub,
        &interfaces,
        &ns,
        &copy_name(&ns, "web-0", &location),
        FIRST_PASS,
        "copy with status",
        |o| serde_json::to_value(o).unwrap()["status"]["phase"] == "Bound",
    )
    .await?;
    // A watched delete: get + delete on the hub.
    fixtures::delete(&cell, &networks, &ns, "deleted-live").await?;
    fixtures::wait_gone(
        &hub,
        &networks,
        &ns,
        &copy_name(&ns, "deleted-live", &location),
        FIRST_PASS,
    )
    .await?;
    // An Event in the cell (events.k8s.io create) on a source whose namespace is not routed.
    let events = Api::<Event>::namespaced(cell.clone(), &unrouted);
    replicator_e2e::wait::until_observed(FIRST_PASS, "the Unroutable Event in the cell", || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            Ok::<_, kube::Error>(
                match list.items.iter().find(|e| {
                    e.reason.as_deref() == Some("Unroutable")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("lost")
                }) {
                    Some(e) => replicator_e2e::wait::Check::Ready(e.clone()),
                    None => replicator_e2e::wait::Check::NotYet(format!("{} events", list.items.len())),
                },
            )
        }
    })
    .await?;
    run.assert_never_forbidden().await;
    run.stop().await;

    // A source deleted while nothing watched: the start-up sweep confirms with a cell GET and
    // deletes the copy.
    fixtures::delete(&cell, &networks, &ns, "deleted-offline").await?;
    let run = Running::start(
        &env,
        &format!("manifests-{ns}-run-2"),
        &run_args,
        &location,
        &hub_kc,
        &cell_arg,
    )
    .await;
    fixtures::wait_gone(
        &hub,
        &networks,
        &ns,
        &copy_name(&ns, "deleted-offline", &location),
        FIRST_PASS,
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &networks,
        &ns,
        &copy_name(&ns, "net", &location),
        FIRST_PASS,
        "kept",
        |_| true,
    )
    .await?;

    // Membership: status apply, slices created through apply and deleted when unwanted, Events.
    // It elects on its Lease in the namespace of the rendered Lease Role, as its identity.
    let membership = Running::start(
        &env,
        &format!("manifests-{ns}-membership"),
        &membership_args,
        "",
        &membership_kc,
        &[
            format!("--lease-namespace={ns}"),
            format!("--identity=manifests-{ns}-membership"),
        ],
    )
    .await;
    let services = fixtures::network_service_resource();
    let mut service = fixtures::network_service(&ns, "svc", "web");
    service["spec"]["ports"] = json!([{"name": "http", "port": 8080}, {"name": "admin", "port": 9090}]);
    fixtures::apply(&hub, &services, &service).await?;
    let slice_api = Api::<EndpointSlice>::namespaced(hub.clone(), &ns);
    let slice_count = |n: usize| {
        let slice_api = slice_api.clone();
        async move {
            replicator_e2e::wait::until_observed(FIRST_PASS, &format!("{n} slices of svc"), || {
                let slice_api = slice_api.clone();
                async move {
                    let list = slice_api
                        .list(&ListParams::default().labels("networking.datumapis.com/network-service=svc"))
                        .await?;
                    let with_endpoint = list
                        .items
                        .iter()
                        .filter(|s| s.endpoints.iter().any(|e| !e.addresses.is_empty()))
                        .count();
                    Ok::<_, kube::Error>(if list.items.len() == n && with_endpoint == n {
                        replicator_e2e::wait::Check::Ready(())
                    } else {
                        replicator_e2e::wait::Check::NotYet(format!(
                            "{} slices, {with_endpoint} with endpoints",
                            list.items.len()
                        ))
                    })
                }
            })
            .await
        }
    };
    slice_count(2).await?;
    fixtures::wait_for(&hub, &services, &ns, "svc", FIRST_PASS, "status written", |o| {
        serde_json::to_value(o).unwrap()["status"]["summary"]["healthy"] == 1
    })
    .await?;
    service["spec"]["ports"] = json!([{"name": "http", "port": 8080}]);
    fixtures::apply(&hub, &services, &service).await?;
    slice_count(1).await?;
    let hub_events = Api::<Event>::namespaced(hub.clone(), &ns);
    replicator_e2e::wait::until_observed(FIRST_PASS, "an Event from replicator-membership", || {
        let hub_events = hub_events.clone();
        async move {
            let list = hub_events.list(&ListParams::default()).await?;
            Ok::<_, kube::Error>(
                if list
                    .items
                    .iter()
                    .any(|e| e.reporting_controller.as_deref() == Some("replicator-membership"))
                {
                    replicator_e2e::wait::Check::Ready(())
                } else {
                    replicator_e2e::wait::Check::NotYet(format!("{} events", list.items.len()))
                },
            )
        }
    })
    .await?;
    run.assert_never_forbidden().await;
    membership.assert_never_forbidden().await;

    run.stop().await;
    membership.stop().await;
    Ok(())
}

/// Where each kustomization goes when deployed as the README says: `crds` to the hub and every
/// cell, each overlay to its cell, `rbac/hub`, each location's hub identity, `hub` and
/// `monitoring` to the hub.
const DEPLOYED: [(&str, Cluster); 10] = [
    ("crds", HUB),
    ("crds", CELL_A),
    ("crds", CELL_B),
    ("rbac/hub", HUB),
    ("overlays/dfw/hub", HUB),
    ("overlays/sjc/hub", HUB),
    ("hub", HUB),
    ("monitoring", HUB),
    ("overlays/dfw", CELL_A),
    ("overlays/sjc", CELL_B),
];
/// The namespace every manifest deploys into.
const SYSTEM_NAMESPACE: &str = "replicator-system";

fn kustomization_dir(dir: &str) -> OsString {
    config_dir().join(dir).into_os_string()
}

/// Removes what [`every_manifest_applies_for_real_as_the_readme_says`] applied (never the CRDs,
/// which the harness installed first and every scenario needs): `kubectl delete -k` of each
/// kustomization; each cluster's namespace controller empties and removes the namespaces (never
/// a forced finalizer: that would leave the namespace's objects in etcd, and the next
/// `replicator-system` would find them). Returns once every namespace is gone.
async fn remove_deployed(env: &Environment) -> Result<(), replicator_e2e::Error> {
    for (dir, cluster) in DEPLOYED {
        if dir == "crds" {
            continue;
        }
        env.kubectl_ok(
            cluster,
            [
                OsString::from("delete"),
                "--ignore-not-found".into(),
                "--wait=false".into(),
                "-k".into(),
                kustomization_dir(dir),
            ],
        )
        .await?;
    }
    for cluster in [HUB, CELL_A, CELL_B] {
        let api = Api::<k8s_openapi::api::core::v1::Namespace>::all(env.client(cluster).await?);
        let what = format!("namespace {SYSTEM_NAMESPACE} to be gone from {cluster}");
        replicator_e2e::wait::until(Duration::from_secs(120), &what, || async {
            Ok::<_, kube::Error>(api.get_opt(SYSTEM_NAMESPACE).await?.is_none().then_some(()))
        })
        .await?;
    }
    Ok(())
}

/// Runs [`remove_deployed`] when dropped unless the test already did (a panic on the way).
struct DeployedCleanup {
    dir: PathBuf,
    armed: bool,
}

impl Drop for DeployedCleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let dir = self.dir.clone();
        // Drop cannot await: a thread with a runtime of its own does the work.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let env = Environment::attach(&dir).await.map_err(std::io::Error::other)?;
                remove_deployed(&env).await.map_err(std::io::Error::other)
            })
        })
        .join();
    }
}

/// Every rendered object of `dir` exists in `cluster` as rendered: `kubectl get -f` of the render
/// returns live objects that contain every rendered field (the server adds defaults and status).
async fn assert_live_as_rendered(env: &Environment, scratch: &Scratch, dir: &str, cluster: Cluster) -> usize {
    let yaml = kustomize(env, &config_dir().join(dir)).await;
    let rendered = objects(&yaml);
    let file = scratch.path(&format!("applied-{}-{}.yaml", dir.replace('/', "-"), cluster.name()));
    std::fs::write(&file, &yaml).unwrap();
    let live: Value = serde_json::from_str(
        &env.kubectl_ok(
            cluster,
            [
                OsString::from("get"),
                "-o".into(),
                "json".into(),
                "-f".into(),
                file.into_os_string(),
            ],
        )
        .await
        .unwrap_or_else(|e| panic!("{dir} not all live in {cluster}: {e}")),
    )
    .unwrap();
    let items = live["items"].as_array().cloned().unwrap_or_else(|| vec![live.clone()]);
    assert_eq!(items.len(), rendered.len(), "{dir} in {cluster}: every object is live");
    for want in &rendered {
        let name = &want["metadata"]["name"];
        let got = items
            .iter()
            .find(|o| o["kind"] == want["kind"] && &o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{dir}: {} {name} not live in {cluster}", want["kind"]));
        // kustomize gives every kind it does not know as cluster-scoped (the admission
        // policies) the kustomization's namespace; the apiserver drops it.
        let mut want = want.clone();
        if got["metadata"].get("namespace").is_none()
            && let Some(meta) = want["metadata"].as_object_mut()
        {
            meta.remove("namespace");
        }
        let want = &want;
        assert!(
            replicator::copy::contains(got, want),
            "{dir}: {} {name} in {cluster} differs from the render:\nrendered {want}\nlive {got}",
            want["kind"]
        );
    }
    rendered.len()
}

#[tokio::test]
async fn every_manifest_applies_for_real_as_the_readme_says() -> TestResult {
    let env = Environment::ensure_up().await?;
    install_monitoring_crds(&env).await;
    let scratch = Scratch::new(&unique("deployed"));
    // A leftover of an interrupted run would make this one pass on stale objects.
    remove_deployed(&env).await?;
    let mut cleanup = DeployedCleanup {
        dir: env.dir().to_path_buf(),
        armed: true,
    };
    // Karmada pushes every hub namespace to every member, and the members run no namespace
    // controller to ever delete it again: the hub's replicator-system is made first, kept from
    // that propagation (server-side apply of the manifests leaves the label alone).
    env.ensure_namespace(HUB, SYSTEM_NAMESPACE).await?;

    for (dir, cluster) in DEPLOYED {
        let out = env
            .kubectl(
                cluster,
                [
                    OsString::from("apply"),
                    "--server-side".into(),
                    format!("--field-manager={FIELD_MANAGER}").into(),
                    "-k".into(),
                    kustomization_dir(dir),
                ],
            )
            .await?;
        assert!(
            out.status.success(),
            "kubectl apply -k config/{dir} to {cluster}: {}",
            output_text(&out)
        );
    }
    // The hub kubeconfig Secrets the README asks for, with tokens of the applied accounts.
    let secret = |name: &str, kubeconfig: &Path| {
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": SYSTEM_NAMESPACE},
            "stringData": {"kubeconfig": std::fs::read_to_string(kubeconfig).unwrap()}})
    };
    let secret_resource = kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::Secret>(&());
    for (sa, secret_name, clusters) in [
        ("replicator-dfw", "karmada-hub-kubeconfig", vec![CELL_A]),
        ("replicator-sjc", "karmada-hub-kubeconfig", vec![CELL_B]),
        ("replicator-membership", "karmada-hub-kubeconfig-membership", vec![HUB]),
    ] {
        let token = env.service_account_token(HUB, SYSTEM_NAMESPACE, sa, "1h").await?;
        let kubeconfig = scratch.path(&format!("{sa}.kubeconfig"));
        rbac::write_token_kubeconfig(&env, HUB, &env.server_url(HUB), &token, &kubeconfig).await?;
        let whoami = env
            .kubectl_ok(
                HUB,
                [
                    "--kubeconfig",
                    &kubeconfig.display().to_string(),
                    "auth",
                    "whoami",
                    "-o",
                    "json",
                ],
            )
            .await?;
        assert!(
            whoami.contains(&format!("system:serviceaccount:{SYSTEM_NAMESPACE}:{sa}")),
            "{whoami}"
        );
        for cluster in clusters {
            fixtures::apply(
                &env.client(cluster).await?,
                &secret_resource,
                &secret(secret_name, &kubeconfig),
            )
            .await?;
        }
    }

    let mut total = 0;
    for (dir, cluster) in DEPLOYED {
        let n = assert_live_as_rendered(&env, &scratch, dir, cluster).await;
        eprintln!("config/{dir}: {n} objects live in {cluster} as rendered");
        total += n;
    }
    // Each cell runs under its own location.
    for (cluster, location) in [(CELL_A, "dfw"), (CELL_B, "sjc")] {
        let configmaps =
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(env.client(cluster).await?, SYSTEM_NAMESPACE);
        let cms = configmaps.list(&ListParams::default()).await?;
        let location_cm = cms
            .items
            .iter()
            .find(|c| {
                c.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("replicator-location-"))
            })
            .unwrap_or_else(|| panic!("no location ConfigMap in {cluster}"));
        assert_eq!(
            location_cm
                .data
                .as_ref()
                .and_then(|d| d.get("location"))
                .map(String::as_str),
            Some(location)
        );
        let deployments =
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(env.client(cluster).await?, SYSTEM_NAMESPACE);
        assert!(deployments.get_opt("replicator").await?.is_some());
    }
    // No kubelet, no deployment controller here: the Deployments are accepted objects (live as
    // rendered above), nothing more. And no member got the hub's namespace from Karmada.
    let edge = Api::<k8s_openapi::api::core::v1::Namespace>::all(env.client(replicator_e2e::EDGE_1).await?);
    assert!(
        edge.get_opt(SYSTEM_NAMESPACE).await?.is_none(),
        "Karmada pushed {SYSTEM_NAMESPACE} to edge-1"
    );
    eprintln!("{total} objects applied and live as rendered");

    cleanup.armed = false;
    remove_deployed(&env).await?;
    for (cluster, kind, name) in [
        (CELL_A, "clusterrole", "replicator-cell"),
        (CELL_B, "clusterrolebinding", "replicator-cell"),
        (HUB, "clusterrole", "replicator-hub"),
        (HUB, "clusterrole", "replicator-membership"),
        (HUB, "clusterrolebinding", "replicator-hub-dfw"),
        (HUB, "clusterrolebinding", "replicator-hub-sjc"),
        (HUB, "validatingadmissionpolicy", "replicator-location"),
        (HUB, "validatingadmissionpolicybinding", "replicator-membership"),
    ] {
        let out = env.kubectl(cluster, ["get", kind, name]).await?;
        assert!(!out.status.success(), "{kind} {name} left in {cluster}");
    }
    Ok(())
}
