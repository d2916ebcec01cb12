//! Deploying the product for real, as the README's "Deploying" section says: the manifests of
//! `config/` applied with `kubectl apply --server-side -k` through an overlay that pins the local
//! image, a hub kubeconfig with a service-account token in Secret `karmada-hub-kubeconfig`, and
//! the pods run by the cells' own kubelets (see [`crate::node`]).
//!
//! The steps the scenarios share: [`write_overlay`] (under `<target>/deploy/<name>/`, since
//! kustomize refuses absolute paths), [`apply`], [`write_hub_kubeconfig`] and [`create_secret`]
//! / [`replace_secret`], [`wait_pods_ready`], [`lease_holder`], [`scrape_metrics`] (a pod's
//! `podIP:8080` from the host), [`logs`], and [`Teardown`], a guard that removes everything a
//! scenario deployed or made, pass or fail.
//!
//! A cell has one `replicator-system`, so one deployment of `replicator run` at a time:
//! scenarios (and anything else that deploys, like the demo) hold [`exclusive`] while they do.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt::Display;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use crate::cluster::Cluster;
use crate::command::{combined_output, describe};
use crate::controlplane::Environment;
use crate::error::{Error, Result, io_context};
use crate::paths;
use crate::rbac::{self, KARMADA_SKIP_PROPAGATION_LABEL};
use crate::replicator_process::http_get;
use crate::wait::{self, Check};

/// The namespace every manifest deploys into (cells and hub alike).
pub const SYSTEM_NAMESPACE: &str = "replicator-system";
/// The Deployment of `replicator run` in a cell (`config/cell`).
pub const DEPLOYMENT: &str = "replicator";
/// The Deployment of `replicator membership` (`config/hub`).
pub const MEMBERSHIP_DEPLOYMENT: &str = "replicator-membership";
/// The Secret both Deployments mount, and its key.
pub const HUB_SECRET: &str = "karmada-hub-kubeconfig";
/// The key of [`HUB_SECRET`] that holds the kubeconfig.
pub const HUB_SECRET_KEY: &str = "kubeconfig";
/// The service account of `replicator run` in a cell (`config/cell`).
pub const CELL_SERVICE_ACCOUNT: &str = "replicator";
/// The hub service account of `replicator membership` (`config/rbac/hub`).
pub const MEMBERSHIP_SERVICE_ACCOUNT: &str = "replicator-membership";
/// Every pod of the product (`replicator run` and `replicator membership`).
pub const PRODUCT_SELECTOR: &str = "app.kubernetes.io/name=replicator";
/// The pods of `replicator run`.
pub const CELL_SELECTOR: &str = "app.kubernetes.io/name=replicator,app.kubernetes.io/component=cell";
/// The pod of `replicator membership`.
pub const MEMBERSHIP_SELECTOR: &str = "app.kubernetes.io/name=replicator,app.kubernetes.io/component=membership";
/// The container port of `/metrics` (`--metrics-bind-address=0.0.0.0:8080`).
pub const METRICS_PORT: u16 = 8080;
/// The container port of `/healthz` and `/readyz` (`--health-probe-bind-address=0.0.0.0:8081`).
pub const PROBES_PORT: u16 = 8081;
/// The image the manifests name, which every overlay here replaces with the local one.
pub const PLACEHOLDER_IMAGE: &str = "ghcr.io/datum-cloud/replicator";
/// The lifetime of the hub tokens put in the Secrets (as the README's example).
const TOKEN_DURATION: &str = "24h";
/// How long a deleted namespace may take to go (pods get their 30 s grace period; the replicator
/// exits within a second of SIGTERM).
const NAMESPACE_GONE: Duration = Duration::from_secs(120);
/// How long a terminating leftover `replicator-system` is waited for before a scenario starts.
const LEFTOVER_GONE: Duration = Duration::from_secs(120);

/// Serialises the deployments of one process (one `replicator-system` per cell).
static DEPLOYING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// The file in the state directory whose lock serialises deployments across processes.
const DEPLOY_LOCK: &str = "deploy.lock";
/// How long [`exclusive`] waits for another process's deployment to finish.
const DEPLOY_LOCK_WAIT: Duration = Duration::from_secs(30 * 60);

/// The cells' `replicator-system`, held for one deployment (see [`exclusive`]).
#[derive(Debug)]
pub struct Exclusive {
    _process: tokio::sync::MutexGuard<'static, ()>,
    _file: Flock<File>,
}

/// Holds the cells for one scenario's deployments until the guard is dropped: within the
/// process and, through a lock on `<state>/deploy.lock`, against every other process that takes
/// it (a test binary, the demo). Declare it before the scenario's [`Teardown`], so that the
/// teardown runs first.
///
/// # Errors
/// The lock file cannot be opened or locked, or another holder keeps it past
/// [`DEPLOY_LOCK_WAIT`].
pub async fn exclusive(env: &Environment) -> Result<Exclusive> {
    let process = DEPLOYING.lock().await;
    let path = env.dir().join(DEPLOY_LOCK);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_context(format!("opening {}", path.display())))?;
    let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            return Ok(Exclusive {
                _process: process,
                _file: lock,
            });
        }
        Err((file, Errno::EWOULDBLOCK)) => file,
        Err((_, errno)) => return Err(io_context(format!("locking {}", path.display()))(errno.into())),
    };
    eprintln!(
        "another process deploys into the cells ({} is locked); waiting",
        path.display()
    );
    let blocking = tokio::task::spawn_blocking(move || Flock::lock(file, FlockArg::LockExclusive));
    match tokio::time::timeout(DEPLOY_LOCK_WAIT, blocking).await {
        Ok(Ok(Ok(lock))) => Ok(Exclusive {
            _process: process,
            _file: lock,
        }),
        Ok(Ok(Err((_, errno)))) => Err(io_context(format!("locking {}", path.display()))(errno.into())),
        Ok(Err(join)) => Err(io_context(format!("locking {}", path.display()))(
            std::io::Error::other(join),
        )),
        Err(_) => Err(Error::Scenario(format!(
            "{} stayed locked for {DEPLOY_LOCK_WAIT:?}",
            path.display()
        ))),
    }
}

/// What an overlay builds on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base<'a> {
    /// `config/overlays/<location>` as shipped (`dfw`, `sjc`).
    Overlay(&'a str),
    /// A location of one's own, made from `config/cell` the way a user adds one: the base plus
    /// `configMapGenerator` `replicator-location` with `behavior: replace`.
    NewLocation(&'a str),
    /// `config/hub` (`replicator membership`), as shipped: it mounts [`MEMBERSHIP_SECRET`].
    Membership,
}

/// The Secret `config/hub` mounts: its own name, so that `replicator membership` can share a
/// cell's `replicator-system` (the hub's host cluster may be a cell) with `replicator run`,
/// whose [`HUB_SECRET`] holds another identity.
pub const MEMBERSHIP_SECRET: &str = "karmada-hub-kubeconfig-membership";

/// `<target>/deploy`: the overlays and hub kubeconfigs the scenarios write.
pub fn deploy_dir() -> PathBuf {
    paths::target_dir().join("deploy")
}

/// `to` relative to the directory `from` (both absolute), for kustomize's `resources:`.
pub fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component<'_>> = from.components().collect();
    let to: Vec<Component<'_>> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for component in &to[common..] {
        rel.push(component.as_os_str());
    }
    rel
}

/// The kustomization text of an overlay of `base` (from `dir`) pinning `image`
/// (`name:tag`, e.g. `localhost/replicator:0123abcd`).
///
/// # Errors
/// [`Error::Config`] for an image without a tag.
pub fn overlay_text(dir: &Path, base: Base<'_>, image: &str) -> Result<String> {
    let (name, tag) = image
        .rsplit_once(':')
        .filter(|(name, tag)| !name.is_empty() && !tag.is_empty() && !tag.contains('/'))
        .ok_or_else(|| Error::Config(format!("image {image:?} has no tag")))?;
    let config = paths::workspace_root().join("config");
    let target = match base {
        Base::Overlay(location) => config.join("overlays").join(location),
        Base::NewLocation(_) => config.join("cell"),
        Base::Membership => config.join("hub"),
    };
    let mut text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\n\
         images:\n- name: {PLACEHOLDER_IMAGE}\n  newName: {name}\n  newTag: \"{tag}\"\n",
        relative(dir, &target).display()
    );
    match base {
        Base::Overlay(_) => {}
        Base::NewLocation(location) => text.push_str(&format!(
            "configMapGenerator:\n- name: replicator-location\n  behavior: replace\n  literals:\n  - location={location}\n"
        )),
        Base::Membership => {}
    }
    Ok(text)
}

/// Writes `<target>/deploy/<name>/kustomization.yaml`, an overlay of `base` pinning `image`;
/// returns the directory.
///
/// # Errors
/// As [`overlay_text`], or when the file cannot be written.
pub fn write_overlay(name: &str, base: Base<'_>, image: &str) -> Result<PathBuf> {
    let dir = deploy_dir().join(name);
    std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
    let file = dir.join("kustomization.yaml");
    std::fs::write(&file, overlay_text(&dir, base, image)?)
        .map_err(io_context(format!("writing {}", file.display())))?;
    Ok(dir)
}

/// `config/<dir>` in the workspace.
pub fn config_dir(dir: &str) -> PathBuf {
    paths::workspace_root().join("config").join(dir)
}

/// `kubectl apply --server-side -k <dir>` on `cluster`, as the README says; returns kubectl's
/// output.
///
/// # Errors
/// When kubectl fails.
pub async fn apply(env: &Environment, cluster: Cluster, dir: &Path) -> Result<String> {
    env.kubectl_ok(
        cluster,
        [
            OsString::from("apply"),
            "--server-side".into(),
            "-k".into(),
            dir.as_os_str().to_owned(),
        ],
    )
    .await
}

/// `config/rbac/hub` on the hub (the roles of every location's identity, membership's service
/// account and roles, the admission policies, the Leases' namespace), as the README's second
/// step. A scenario uses [`apply_hub_rbac_for`], which also makes the locations' identities and
/// has its [`Teardown`] remove them.
///
/// # Errors
/// As [`apply`].
pub async fn apply_hub_rbac(env: &Environment) -> Result<()> {
    apply(env, Cluster::Hub, &config_dir("rbac/hub")).await.map(drop)
}

/// The hub service account of `replicator run` for `location`, in [`SYSTEM_NAMESPACE`]:
/// `replicator-<location>` (`config/overlays/<location>/hub`). A cell's Secret [`HUB_SECRET`]
/// holds a token of it.
pub fn run_service_account(location: &str) -> String {
    rbac::hub_service_account(location)
}

/// The hub identity of `location` as an operator makes it: `config/overlays/<location>/hub` for a
/// location the repository ships (dfw, sjc); for another, the same thing made the way that
/// overlay's comment says (`config/rbac/hub/location` with `nameSuffix: -<location>`), written
/// to `<target>/deploy/hub-<location>/kustomization.yaml`. Returns the kustomization directory
/// and whether it was written here.
///
/// # Errors
/// A location that cannot name an identity, or a file that cannot be written.
pub fn hub_identity_overlay(location: &str) -> Result<(PathBuf, bool)> {
    rbac::validate_location(location)?;
    let shipped = config_dir("overlays").join(location).join("hub");
    if shipped.join("kustomization.yaml").is_file() {
        return Ok((shipped, false));
    }
    let dir = deploy_dir().join(format!("hub-{location}"));
    std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
    let text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnameSuffix: -{location}\nresources:\n- {}\n",
        relative(&dir, &config_dir("rbac/hub/location")).display()
    );
    let file = dir.join("kustomization.yaml");
    std::fs::write(&file, text).map_err(io_context(format!("writing {}", file.display())))?;
    Ok((dir, true))
}

/// The README's hub steps for `locations`: `config/rbac/hub` ([`apply_hub_rbac`]), then each
/// location's identity ([`hub_identity_overlay`]: service account `replicator-<location>` of
/// [`SYSTEM_NAMESPACE`] and its bindings). `teardown` removes the identities (`kubectl delete -k`
/// of each) and the admission policies of `config/rbac/hub` under their shipped names; the
/// harness's own (`-e2e`, [`crate::rbac`]) are never touched.
///
/// # Errors
/// As [`apply`] and [`hub_identity_overlay`].
pub async fn apply_hub_rbac_for(env: &Environment, teardown: &mut Teardown, locations: &[&str]) -> Result<()> {
    teardown.hub_policies = true;
    apply_hub_rbac(env).await?;
    for location in locations {
        let (dir, written) = hub_identity_overlay(location)?;
        if written {
            teardown.path(&dir);
        }
        teardown.hub_identities.push(dir.clone());
        apply(env, Cluster::Hub, &dir).await?;
    }
    Ok(())
}

/// The admission policies (and their bindings) `config/rbac/hub` holds, as `kind/name` under
/// their shipped names: what [`Teardown`] removes after [`apply_hub_rbac_for`].
///
/// # Errors
/// When `kubectl kustomize` fails or its output does not parse.
pub async fn shipped_admission_policies(env: &Environment) -> Result<Vec<String>> {
    let yaml = env
        .kubectl_ok(
            Cluster::Hub,
            [OsString::from("kustomize"), config_dir("rbac/hub").into_os_string()],
        )
        .await?;
    let objects = serde_saphyr::from_multiple::<serde_json::Value>(&yaml)
        .map_err(|e| Error::Config(format!("parsing the render of config/rbac/hub: {e}")))?;
    Ok(objects
        .iter()
        .filter_map(|o| {
            let kind = o["kind"].as_str()?;
            let name = o["metadata"]["name"].as_str()?;
            matches!(kind, "ValidatingAdmissionPolicy" | "ValidatingAdmissionPolicyBinding")
                .then(|| format!("{}.admissionregistration.k8s.io/{name}", kind.to_ascii_lowercase()))
        })
        .collect())
}

/// Writes to `path` a hub kubeconfig for pods: the hub as a pod dials it
/// ([`Environment::pod_reachable_server_url`]), the environment's CA, and a fresh token of hub
/// service account `replicator-system/<service_account>` (`kubectl create token`).
///
/// # Errors
/// When the token cannot be issued or the file written.
pub async fn write_hub_kubeconfig(env: &Environment, service_account: &str, path: &Path) -> Result<()> {
    let token = env
        .service_account_token(Cluster::Hub, SYSTEM_NAMESPACE, service_account, TOKEN_DURATION)
        .await?;
    let server = env.pod_reachable_server_url(Cluster::Hub).await?;
    write_kubeconfig(env, &server, &token, path).await
}

/// Writes to `path` a hub kubeconfig naming `server` and `token` (with the environment's CA):
/// also the broken ones.
///
/// # Errors
/// When the CA cannot be read or the file written.
pub async fn write_kubeconfig(env: &Environment, server: &str, token: &str, path: &Path) -> Result<()> {
    rbac::write_token_kubeconfig(env, Cluster::Hub, server, token, path).await
}

/// `kubectl -n replicator-system create secret generic <name> --from-file=kubeconfig=<file>` in
/// `cluster`, as the README says.
///
/// # Errors
/// When kubectl fails (for example the Secret exists).
pub async fn create_secret(env: &Environment, cluster: Cluster, name: &str, kubeconfig: &Path) -> Result<()> {
    env.kubectl_ok(cluster, secret_args(name, kubeconfig, false))
        .await
        .map(drop)
}

/// Replaces Secret `name` with one holding `kubeconfig`, as an operator fixes it:
/// `kubectl create secret ... --dry-run=client -o yaml | kubectl apply -f -`.
///
/// # Errors
/// When either kubectl fails.
pub async fn replace_secret(env: &Environment, cluster: Cluster, name: &str, kubeconfig: &Path) -> Result<()> {
    let yaml = env.kubectl_ok(cluster, secret_args(name, kubeconfig, true)).await?;
    let mut command = Command::new(&env.binaries().kubectl);
    command
        .arg("--kubeconfig")
        .arg(env.kubeconfig_path(cluster))
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = describe(&command);
    let mut child = command.spawn().map_err(io_context(format!("running `{what}`")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(yaml.as_bytes())
            .await
            .map_err(io_context(format!("writing to `{what}`")))?;
    }
    let output = child
        .wait_with_output()
        .await
        .map_err(io_context(format!("running `{what}`")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(Error::CommandFailed {
            command: what,
            status: output.status,
            output: combined_output(&output),
        })
    }
}

fn secret_args(name: &str, kubeconfig: &Path, dry_run: bool) -> Vec<OsString> {
    let mut from_file = OsString::from(format!("--from-file={HUB_SECRET_KEY}="));
    from_file.push(kubeconfig);
    let mut args: Vec<OsString> = ["-n", SYSTEM_NAMESPACE, "create", "secret", "generic", name]
        .map(OsString::from)
        .to_vec();
    args.push(from_file);
    if dry_run {
        args.extend(["--dry-run=client", "-o", "yaml"].map(OsString::from));
    }
    args
}

/// Creates namespace `name` in each of `clusters` with the project-routing labels and Karmada's
/// skip-propagation label: a scenario's sources and copies land there, and no member outside the
/// scenario gets it (edge-1 has no namespace controller to ever remove it again).
///
/// # Errors
/// Any API error other than AlreadyExists.
pub async fn routed_namespace(env: &Environment, clusters: &[Cluster], name: &str) -> Result<()> {
    let labels: std::collections::BTreeMap<String, String> = [
        (
            replicator::routing::UPSTREAM_CLUSTER_LABEL,
            crate::fixtures::UPSTREAM_CLUSTER,
        ),
        (replicator::routing::UPSTREAM_NAMESPACE_LABEL, "default"),
        (KARMADA_SKIP_PROPAGATION_LABEL, "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    for cluster in clusters {
        let api = Api::<Namespace>::all(env.client(*cluster).await?);
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(labels.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Fails unless `cell` has no `replicator-system` (a terminating one is waited for): a scenario
/// never deploys over somebody else's deployment, nor removes it.
///
/// Objects left in etcd under a `replicator-system` that is gone (its finalizer was forced
/// instead of its controller emptying it) would reappear in the next one, a Secret among them;
/// pods among them stay forever, since their kubelet cannot report on them. Such leftovers are
/// removed the regular way first: the namespace is made again and deleted, and its controller
/// empties it.
///
/// # Errors
/// [`Error::Aborted`] naming what is in the way, or a timeout.
pub async fn require_free(env: &Environment, cell: Cluster) -> Result<()> {
    let client = env.client(cell).await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    let kubeconfig = env.kubeconfig_path(cell);
    let what = format!("{cell} to have no namespace {SYSTEM_NAMESPACE}");
    let free = || {
        let (namespaces, client, kubeconfig) = (namespaces.clone(), client.clone(), &kubeconfig);
        async move {
            let pods = pods(&client, PRODUCT_SELECTOR).await?;
            Ok::<_, Error>(match namespaces.get_opt(SYSTEM_NAMESPACE).await? {
                None => Check::Ready(()),
                Some(ns) if ns.metadata.deletion_timestamp.is_some() => {
                    Check::NotYet(format!("terminating; {}", describe_pods(&pods)))
                }
                Some(_) => Check::Abort(format!(
                    "{cell} already runs something in {SYSTEM_NAMESPACE} (a deployment this scenario did not \
                     make: {}); remove it first: kubectl --kubeconfig {} delete namespace {SYSTEM_NAMESPACE}, \
                     and ClusterRole and ClusterRoleBinding replicator-cell",
                    describe_pods(&pods),
                    kubeconfig.display()
                )),
            })
        }
    };
    wait::until_observed(LEFTOVER_GONE, &what, free).await?;
    let orphans = env
        .kubectl_ok(
            cell,
            [
                "-n",
                SYSTEM_NAMESPACE,
                "get",
                ORPHAN_KINDS,
                "-o",
                "name",
                "--ignore-not-found",
            ],
        )
        .await?;
    let orphans: Vec<&str> = orphans.lines().filter(|l| !l.trim().is_empty()).collect();
    if !orphans.is_empty() {
        eprintln!(
            "{cell}: objects left under the removed namespace {SYSTEM_NAMESPACE} ({}); making it again and \
             deleting it, so that its controller removes them",
            orphans.join(", ")
        );
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(SYSTEM_NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match namespaces.create(&PostParams::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        delete_namespace(env, cell, SYSTEM_NAMESPACE).await?;
        wait_namespace_gone(env, cell, SYSTEM_NAMESPACE).await?;
    }
    Ok(())
}

/// The kinds a deployment makes in `replicator-system`, and what its pods add, looked for by
/// [`require_free`].
const ORPHAN_KINDS: &str =
    "pods,secrets,configmaps,serviceaccounts,deployments.apps,replicasets.apps,services,poddisruptionbudgets.policy";

/// The pods of `selector` in `replicator-system`, by name.
///
/// # Errors
/// The API error.
pub async fn pods(client: &Client, selector: &str) -> Result<Vec<Pod>> {
    let api = Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut items = api.list(&ListParams::default().labels(selector)).await?.items;
    items.sort_by_key(ResourceExt::name_any);
    Ok(items)
}

/// Whether the pod's Ready condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    condition(pod, "Ready") == Some("True")
}

/// The status of the pod's condition `type_`, if it has one.
pub fn condition<'a>(pod: &'a Pod, type_: &str) -> Option<&'a str> {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == type_))
        .map(|c| c.status.as_str())
}

/// Whether the pod is being deleted.
pub fn is_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// The restarts of the pod's containers, summed.
pub fn restart_count(pod: &Pod) -> i32 {
    container_statuses(pod).map(|c| c.restart_count).sum()
}

/// The reason the pod's first container waits (`ContainerCreating`, ...), if it waits.
pub fn waiting_reason(pod: &Pod) -> Option<&str> {
    container_statuses(pod)
        .next()
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.waiting.as_ref())
        .and_then(|w| w.reason.as_deref())
}

/// Whether the pod's containers all run.
pub fn is_running(pod: &Pod) -> bool {
    let mut statuses = container_statuses(pod).peekable();
    statuses.peek().is_some() && statuses.all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
}

fn container_statuses(pod: &Pod) -> impl Iterator<Item = &k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
}

/// The pod's IP, once it has one.
pub fn pod_ip(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.pod_ip.as_deref())
}

/// One line per pod: name, phase, waiting reason, Ready, restarts (for timeout messages).
pub fn describe_pods(pods: &[Pod]) -> String {
    if pods.is_empty() {
        return "no pods".to_owned();
    }
    pods.iter()
        .map(|p| {
            format!(
                "{} phase={} waiting={} ready={} restarts={}{}",
                p.name_any(),
                p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("?"),
                waiting_reason(p).unwrap_or("-"),
                condition(p, "Ready").unwrap_or("?"),
                restart_count(p),
                if is_terminating(p) { " terminating" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Waits until exactly `count` pods of `selector` exist, none terminating, all Ready; returns
/// them.
///
/// # Errors
/// [`Error::Timeout`] with the pods as last seen.
pub async fn wait_pods_ready(client: &Client, selector: &str, count: usize, deadline: Duration) -> Result<Vec<Pod>> {
    let what = format!("{count} Ready pods of {selector} in {SYSTEM_NAMESPACE}");
    wait::until_observed(deadline, &what, || async {
        let pods = pods(client, selector).await?;
        let ready = pods.len() == count && pods.iter().all(|p| is_ready(p) && !is_terminating(p));
        Ok::<_, Error>(if ready {
            Check::Ready(pods)
        } else {
            Check::NotYet(describe_pods(&pods))
        })
    })
    .await
}

/// Waits until no pod of `selector` is left.
///
/// # Errors
/// [`Error::Timeout`] with the pods as last seen.
pub async fn wait_pods_gone(client: &Client, selector: &str, deadline: Duration) -> Result<()> {
    let what = format!("every pod of {selector} in {SYSTEM_NAMESPACE} to be gone");
    wait::until_observed(deadline, &what, || async {
        let pods = pods(client, selector).await?;
        Ok::<_, Error>(if pods.is_empty() {
            Check::Ready(())
        } else {
            Check::NotYet(describe_pods(&pods))
        })
    })
    .await
}

/// The Warning Events of `reason` the cell recorded on pod `pod`, their messages.
///
/// # Errors
/// The API error.
pub async fn pod_events(client: &Client, pod: &str, reason: &str) -> Result<Vec<String>> {
    let api = Api::<Event>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let fields = format!("involvedObject.kind=Pod,involvedObject.name={pod},reason={reason}");
    Ok(api
        .list(&ListParams::default().fields(&fields))
        .await?
        .items
        .into_iter()
        .map(|e| e.message.unwrap_or_default())
        .collect())
}

/// The holder of a location's Lease as the hub has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// `holderIdentity`: `<pod name>_<pid>`.
    pub identity: String,
    /// `acquireTime`, in milliseconds since the Unix epoch.
    pub acquired_ms: Option<i64>,
    /// `leaseTransitions`.
    pub transitions: i32,
}

impl Holder {
    /// The pod of the identity: a replica's identity is its pod name (`$POD_NAME`).
    pub fn pod(&self) -> &str {
        &self.identity
    }
}

/// The name of a location's Lease: `replicator-<location>`.
pub fn lease_name(location: &str) -> String {
    replicator::election::lease_name(location)
}

/// The holder of Lease `replicator-<location>` on the hub; `None` when the Lease is absent or
/// held by nobody.
///
/// # Errors
/// The API error.
pub async fn lease_holder(hub: &Client, location: &str) -> Result<Option<Holder>> {
    let api = Api::<Lease>::namespaced(hub.clone(), SYSTEM_NAMESPACE);
    Ok(api.get_opt(&lease_name(location)).await?.and_then(|l| holder(&l)))
}

/// The holder a Lease names, if any.
pub fn holder(lease: &Lease) -> Option<Holder> {
    let spec = lease.spec.as_ref()?;
    let identity = spec.holder_identity.clone().filter(|i| !i.is_empty())?;
    Some(Holder {
        identity,
        acquired_ms: spec.acquire_time.as_ref().map(|t| t.0.as_millisecond()),
        transitions: spec.lease_transitions.unwrap_or_default(),
    })
}

/// `GET http://<pod IP>:8080/metrics` from the host, with no `Accept` header (the body is
/// OpenMetrics text).
///
/// # Errors
/// The pod has no IP yet, or the request fails or answers other than 200.
pub async fn scrape_metrics(pod: &Pod) -> Result<String> {
    scrape_metrics_accepting(pod, None).await.map(|(_, body)| body)
}

/// `GET http://<pod IP>:8080/metrics` from the host with `Accept: <accept>` (none when `None`):
/// the response's `content-type` (empty when absent) and body.
///
/// # Errors
/// As [`scrape_metrics`].
pub async fn scrape_metrics_accepting(pod: &Pod, accept: Option<&str>) -> Result<(String, String)> {
    let ip = pod_ip(pod).ok_or_else(|| Error::Scenario(format!("pod {} has no IP yet", pod.name_any())))?;
    let url = format!("http://{ip}:{METRICS_PORT}/metrics");
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    let mut request = client.get(&url);
    if let Some(accept) = accept {
        request = request.header(reqwest::header::ACCEPT, accept);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response.text().await?;
    if status == 200 {
        Ok((content_type, body))
    } else {
        Err(Error::Scenario(format!("{url} answered {status}: {body}")))
    }
}

/// `GET http://<pod IP>:8081/readyz` from the host: the status and the body (the problems that
/// keep the pod unready).
///
/// # Errors
/// The pod has no IP yet, or the request fails.
pub async fn readyz(pod: &Pod) -> Result<(u16, String)> {
    let ip = pod_ip(pod).ok_or_else(|| Error::Scenario(format!("pod {} has no IP yet", pod.name_any())))?;
    http_get(&format!("http://{ip}:{PROBES_PORT}/readyz")).await
}

/// `kubectl -n replicator-system logs <pod>` in `cell` (`--previous`: the container before its
/// last restart).
///
/// # Errors
/// When kubectl fails.
pub async fn logs(env: &Environment, cell: Cluster, pod: &str, previous: bool) -> Result<String> {
    let mut args = vec!["-n", SYSTEM_NAMESPACE, "logs", pod];
    if previous {
        args.push("--previous");
    }
    env.kubectl_ok(cell, args).await
}

/// Holds while `check` keeps reporting [`Check::Ready`] for all of `period` (polled the way
/// [`wait::until_observed`] polls); fails at the first observation that breaks it. For "stays
/// so for a while" assertions, bounded by `period`.
///
/// # Errors
/// [`Error::Scenario`] naming `what` and the observation that broke it.
pub async fn stays<T, E, F, Fut>(period: Duration, what: &str, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Check<T>, E>>,
    E: Display,
{
    let outcome = wait::until_observed(period, what, || {
        let pending = check();
        async move {
            Ok::<_, String>(match pending.await {
                Ok(Check::Ready(_)) => Check::NotYet("holds".to_owned()),
                Ok(Check::NotYet(seen) | Check::Abort(seen)) => Check::Ready(seen),
                Err(error) => Check::Ready(format!("the check failed: {error}")),
            })
        }
    })
    .await;
    match outcome {
        Err(Error::Timeout { .. }) => Ok(()),
        Ok(broken) => Err(Error::Scenario(format!("{what} stopped holding: {broken}"))),
        Err(other) => Err(other),
    }
}

/// Removes, when run or dropped, everything a scenario deployed or made, in an order that lets
/// nothing come back: the applied kustomizations (`kubectl delete -k`, cluster-scoped RBAC
/// included) and each cell's `replicator-system` (waited for: the pods stop first, and a stopping
/// leader releases its Lease), the scenario's namespaces (waited for), the copies its locations
/// published on the hub since [`Teardown::new`] (elsewhere too: a deployed replicator mirrors
/// the whole cell), the locations' Leases (deployed or bare), and its files under `<target>/deploy`.
/// After [`apply_hub_rbac_for`], the locations' hub identities (`replicator-<location>` of
/// `replicator-system`, with their bindings) go once the pods are gone, and the admission
/// policies of `config/rbac/hub` under their shipped names go last; the harness's identities and
/// policies ([`crate::rbac`], namespace `replicator-e2e`, `-e2e` names) are never touched.
///
/// Run it with [`Teardown::finish`] to see errors; a panicking scenario runs it on drop.
#[derive(Debug)]
pub struct Teardown {
    state_dir: PathBuf,
    applied: Vec<(Cluster, PathBuf)>,
    cells: BTreeSet<Cluster>,
    namespaces: Vec<(Cluster, String)>,
    locations: Vec<String>,
    kept_copies: BTreeSet<String>,
    paths: Vec<PathBuf>,
    hub_identities: Vec<PathBuf>,
    hub_policies: bool,
    armed: bool,
}

impl Teardown {
    /// A teardown for `locations`; remembers the copies they hold on the hub now, which it
    /// leaves alone.
    ///
    /// # Errors
    /// A failed list on the hub.
    pub async fn new(env: &Environment, locations: &[&str]) -> Result<Teardown> {
        let hub = env.client(Cluster::Hub).await?;
        let mut kept_copies = BTreeSet::new();
        for location in locations {
            for copy in copies_of(&hub, location).await? {
                kept_copies.extend(copy.uid());
            }
        }
        Ok(Teardown {
            state_dir: env.dir().to_path_buf(),
            applied: Vec::new(),
            cells: BTreeSet::new(),
            namespaces: Vec::new(),
            locations: locations.iter().map(|l| (*l).to_owned()).collect(),
            kept_copies,
            paths: Vec::new(),
            hub_identities: Vec::new(),
            hub_policies: false,
            armed: true,
        })
    }

    /// A kustomization applied to `cluster`, to `kubectl delete -k`; for a cell, its
    /// `replicator-system` is removed and waited for as well.
    pub fn applied(&mut self, cluster: Cluster, dir: &Path) {
        self.applied.push((cluster, dir.to_path_buf()));
        if cluster.is_cell() {
            self.cells.insert(cluster);
        }
    }

    /// A cell whose `replicator-system` goes (also when nothing was applied yet).
    pub fn cell(&mut self, cell: Cluster) {
        self.cells.insert(cell);
    }

    /// A namespace the scenario made in `cluster`.
    pub fn namespace(&mut self, cluster: Cluster, name: &str) {
        self.namespaces.push((cluster, name.to_owned()));
    }

    /// A file or directory to remove.
    pub fn path(&mut self, path: &Path) {
        self.paths.push(path.to_path_buf());
    }

    /// Runs the teardown now; every step is tried, the first error is returned.
    ///
    /// # Errors
    /// The first step that failed.
    pub async fn finish(mut self, env: &Environment) -> Result<()> {
        self.armed = false;
        self.remove(env).await
    }

    async fn remove(&self, env: &Environment) -> Result<()> {
        let mut first: Option<Error> = None;
        let mut note = |result: Result<()>| {
            if let Err(error) = result {
                eprintln!("teardown: {error}");
                first.get_or_insert(error);
            }
        };
        for (cluster, dir) in self.applied.iter().rev() {
            if dir.join("kustomization.yaml").is_file() || dir.join("kustomization.yml").is_file() {
                note(
                    env.kubectl_ok(
                        *cluster,
                        [
                            OsString::from("delete"),
                            "--ignore-not-found".into(),
                            "--wait=false".into(),
                            "-k".into(),
                            dir.as_os_str().to_owned(),
                        ],
                    )
                    .await
                    .map(drop),
                );
            }
        }
        for cell in &self.cells {
            note(delete_namespace(env, *cell, SYSTEM_NAMESPACE).await);
        }
        for (cluster, name) in &self.namespaces {
            note(delete_namespace(env, *cluster, name).await);
        }
        for cell in &self.cells {
            note(wait_namespace_gone(env, *cell, SYSTEM_NAMESPACE).await);
        }
        for (cluster, name) in &self.namespaces {
            note(wait_namespace_gone(env, *cluster, name).await);
        }
        note(self.remove_copies_and_leases(env).await);
        // The hub identities once their pods are gone (a stopping leader releases its Lease as
        // that identity).
        for dir in self.hub_identities.iter().rev() {
            note(
                env.kubectl_ok(
                    Cluster::Hub,
                    [
                        OsString::from("delete"),
                        "--ignore-not-found".into(),
                        "-k".into(),
                        dir.as_os_str().to_owned(),
                    ],
                )
                .await
                .map(drop),
            );
        }
        if self.hub_policies {
            note(remove_shipped_admission_policies(env).await);
        }
        for path in &self.paths {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(path)
            } else {
                std::fs::remove_file(path)
            };
            match removed {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => note(Err(io_context(format!("removing {}", path.display()))(error))),
            }
        }
        // The overlays' parent goes too once empty (nothing else writes there).
        let _ = std::fs::remove_dir(deploy_dir());
        first.map_or(Ok(()), Err)
    }

    async fn remove_copies_and_leases(&self, env: &Environment) -> Result<()> {
        let hub = env.client(Cluster::Hub).await?;
        for location in &self.locations {
            for copy in copies_of(&hub, location).await? {
                if copy.uid().is_some_and(|uid| self.kept_copies.contains(&uid)) {
                    continue;
                }
                let (Some(namespace), name) = (copy.namespace(), copy.name_any()) else {
                    continue;
                };
                let resource = copy
                    .types
                    .as_ref()
                    .and_then(|t| resource_of(&t.kind))
                    .ok_or_else(|| Error::Scenario(format!("copy {namespace}/{name} of unknown kind")))?;
                crate::fixtures::delete(&hub, &resource, &namespace, &name).await?;
            }
            // Deployed replicas keep their Leases in `replicator-system`, bare processes in the
            // harness identities' namespace.
            for namespace in [SYSTEM_NAMESPACE, crate::rbac::NAMESPACE] {
                let leases = Api::<Lease>::namespaced(hub.clone(), namespace);
                match leases.delete(&lease_name(location), &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        // The membership Lease of a deployed config/hub (bare processes elect in their own namespace).
        if !self.applied.is_empty() {
            let leases = Api::<Lease>::namespaced(hub.clone(), SYSTEM_NAMESPACE);
            match leases
                .delete(replicator::membership::LEASE, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        let this = Teardown {
            state_dir: self.state_dir.clone(),
            applied: std::mem::take(&mut self.applied),
            cells: std::mem::take(&mut self.cells),
            namespaces: std::mem::take(&mut self.namespaces),
            locations: std::mem::take(&mut self.locations),
            kept_copies: std::mem::take(&mut self.kept_copies),
            paths: std::mem::take(&mut self.paths),
            hub_identities: std::mem::take(&mut self.hub_identities),
            hub_policies: self.hub_policies,
            armed: false,
        };
        // Drop cannot await: a thread with a runtime of its own does the work.
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let env = Environment::attach(&this.state_dir).await.map_err(|e| e.to_string())?;
                this.remove(&env).await.map_err(|e| e.to_string())
            })
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("tearing the deployment down failed: {error}"),
            Err(_) => eprintln!("tearing the deployment down panicked"),
        }
    }
}

/// Deletes the admission policies of `config/rbac/hub` under their shipped names (never the
/// harness's `-e2e` ones, which the bare processes of other scenarios run under).
async fn remove_shipped_admission_policies(env: &Environment) -> Result<()> {
    let names = shipped_admission_policies(env).await?;
    if names.iter().any(|n| n.ends_with(&format!("-{}", rbac::NAME_SUFFIX))) {
        return Err(Error::Config(format!(
            "config/rbac/hub names an admission policy like the harness's own: {names:?}"
        )));
    }
    if names.is_empty() {
        return Ok(());
    }
    let mut args: Vec<OsString> = vec!["delete".into(), "--ignore-not-found".into()];
    args.extend(names.into_iter().map(OsString::from));
    env.kubectl_ok(Cluster::Hub, args).await.map(drop)
}

/// Every copy `location` holds on the hub, of every default rule's kind (metadata only).
async fn copies_of(hub: &Client, location: &str) -> Result<Vec<DynamicObject>> {
    let selector = format!("{}={location}", replicator::rules::LOCATION_LABEL);
    let mut all = Vec::new();
    for rule in replicator::rules::default_rules() {
        let resource = rule.resource.api_resource();
        let list = Api::<DynamicObject>::all_with(hub.clone(), &resource)
            .list(&ListParams::default().labels(&selector))
            .await?;
        all.extend(list.items.into_iter().map(|mut o| {
            o.types = Some(kube::api::TypeMeta {
                api_version: resource.api_version.clone(),
                kind: resource.kind.clone(),
            });
            o
        }));
    }
    Ok(all)
}

fn resource_of(kind: &str) -> Option<kube::discovery::ApiResource> {
    replicator::rules::default_rules()
        .into_iter()
        .map(|r| r.resource.api_resource())
        .find(|r| r.kind == kind)
}

/// Removes deployments as a user does: `kubectl delete -k` of each applied kustomization, then
/// waits until each cell's `replicator-system` is gone (its namespace controller deletes the
/// pods, which release their Leases).
///
/// # Errors
/// A failed kubectl or API call, or a namespace not gone in time.
pub async fn undeploy(env: &Environment, applied: &[(Cluster, PathBuf)]) -> Result<()> {
    for (cluster, dir) in applied.iter().rev() {
        env.kubectl_ok(
            *cluster,
            [
                OsString::from("delete"),
                "--ignore-not-found".into(),
                "--wait=false".into(),
                "-k".into(),
                dir.as_os_str().to_owned(),
            ],
        )
        .await?;
    }
    let cells: BTreeSet<Cluster> = applied
        .iter()
        .map(|(cluster, _)| *cluster)
        .filter(|c| c.is_cell())
        .collect();
    for cell in cells {
        delete_namespace(env, cell, SYSTEM_NAMESPACE).await?;
        wait_namespace_gone(env, cell, SYSTEM_NAMESPACE).await?;
    }
    Ok(())
}

async fn delete_namespace(env: &Environment, cluster: Cluster, name: &str) -> Result<()> {
    let api = Api::<Namespace>::all(env.client(cluster).await?);
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn wait_namespace_gone(env: &Environment, cluster: Cluster, name: &str) -> Result<()> {
    let api = Api::<Namespace>::all(env.client(cluster).await?);
    let what = format!("namespace {name} to be gone from {cluster}");
    wait::until_observed(NAMESPACE_GONE, &what, || {
        let api = api.clone();
        async move {
            Ok::<_, kube::Error>(match api.get_opt(name).await? {
                None => Check::Ready(()),
                Some(ns) => Check::NotYet(format!(
                    "{}: {:?}",
                    ns.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("?"),
                    ns.status.as_ref().and_then(|s| s.conditions.as_ref())
                )),
            })
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_to_the_common_ancestor() {
        assert_eq!(
            relative(Path::new("/w/target/deploy/dfw"), Path::new("/w/config/cell")),
            PathBuf::from("../../../config/cell")
        );
        assert_eq!(
            relative(Path::new("/tmp/t/deploy/x"), Path::new("/w/config/hub")),
            PathBuf::from("../../../../w/config/hub")
        );
    }

    #[test]
    fn overlays_pin_the_image_and_set_the_location() -> anyhow::Result<()> {
        let dir = paths::workspace_root().join("target").join("deploy").join("loc-1");
        let text = overlay_text(&dir, Base::NewLocation("loc-1"), "localhost/replicator:0123abcd")?;
        assert_eq!(
            text,
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- ../../../config/cell\n\
             images:\n- name: ghcr.io/datum-cloud/replicator\n  newName: localhost/replicator\n  newTag: \"0123abcd\"\n\
             configMapGenerator:\n- name: replicator-location\n  behavior: replace\n  literals:\n  - location=loc-1\n"
        );
        let text = overlay_text(&dir, Base::Membership, "localhost:5000/r:1")?;
        assert!(text.contains("newName: localhost:5000/r\n"), "{text}");
        assert!(text.contains("- ../../../config/hub\n"), "{text}");
        assert!(overlay_text(&dir, Base::Overlay("dfw"), "localhost:5000/r").is_err());
        Ok(())
    }
}
