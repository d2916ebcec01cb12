//! Least-privilege identities for the `replicator` processes the scenarios run, and the pieces
//! for applying `config/` manifests to the environment (wrapper kustomizations, service-account
//! tokens, token kubeconfigs).
//!
//! By default [`crate::ReplicatorProcess::spawn`] runs `replicator run --location L` with a
//! token of a cell service account bound to exactly the ClusterRole rendered from
//! `config/rbac/cell`, and a token of the hub service account `replicator-L`, bound the way
//! `config/rbac/hub/location` binds a location's identity (ClusterRole `replicator-hub`, Role
//! `replicator-lease`); `replicator membership` runs as the hub's `replicator-membership`. Every
//! scenario thereby exercises the shipped RBAC and the shipped admission policies
//! (`config/rbac/hub/admission_policy.yaml`, which confine `replicator-<location>` to that
//! location's copies and Lease and `replicator-membership` to its slices): a verb missing from a
//! role, or a write the policies refuse, fails the scenario.
//!
//! The manifests are rendered through wrapper kustomizations that move them into namespace
//! [`NAMESPACE`] and suffix the names of cluster-scoped objects (ClusterRoles,
//! ClusterRoleBindings, ValidatingAdmissionPolicies and their bindings) with `-`[`NAME_SUFFIX`],
//! so that a scenario that applies the manifests as shipped (`replicator-system`) and removes
//! them never pulls these from under the other scenarios. The hub's service accounts keep their
//! shipped names (the admission policies recognise an identity by its account name): namespace
//! [`NAMESPACE`] tells them apart from a shipped deployment's. The cells' (which have no
//! admission policies) are suffixed too.
//!
//! [`Environment::least_privilege`] creates the cell identities, the hub's roles and policies and
//! the membership identity once per environment, idempotently: `kubectl apply --server-side` of
//! the render, then `kubectl create token`. [`Identities::hub_kubeconfig_for`] creates the hub
//! identity of one location on first use (`replicator-<location>`, labelled
//! [`LOCATION_IDENTITY_LABEL`]). Both are environment fixtures: created once (per environment,
//! per location), shared by every scenario and test process, never removed by a scenario's
//! teardown (another scenario may be running as the same identity) and gone with the environment
//! (`replicator-env down` destroys it; nothing to clean up). The kubeconfigs live in
//! `<state>/kubeconfigs/least-privilege/` (per location under `locations/`), each beside a stamp
//! with the digest of what was applied and when the token was issued; later calls reuse them
//! while the stamp matches, the token is young and still authenticates as its account.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::cluster::Cluster;
use crate::controlplane::{Environment, lock_dir};
use crate::error::{Error, Result, io_context};
use crate::files::write_private;
use crate::kubeconfig;
use crate::paths;
use crate::wait::{self, Check};

/// The namespace of the harness's service accounts (in the hub and in both cells).
pub const NAMESPACE: &str = "replicator-e2e";
/// The suffix the wrapper kustomizations append to the names of cluster-scoped objects on the
/// hub (`replicator-hub-e2e`, `replicator-location-e2e`, ...) and to every name in the cells
/// (`replicator-e2e`, `replicator-cell-e2e`). The hub's service accounts keep their shipped names.
pub const NAME_SUFFIX: &str = "e2e";
/// The kinds of cluster-scoped objects `config/rbac/hub` holds: the harness suffixes their names
/// with `-`[`NAME_SUFFIX`] (kustomize does not know that the admission policies are
/// cluster-scoped; it is told which kinds to rename instead).
pub const CLUSTER_SCOPED_KINDS: [&str; 4] = [
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];
/// The label (value `"true"`) on every object of a location's hub identity
/// ([`Identities::hub_kubeconfig_for`]).
pub const LOCATION_IDENTITY_LABEL: &str = "replicator-e2e/location-identity";
/// The label naming the location of a location's hub identity objects.
pub const LOCATION_IDENTITY_LOCATION_LABEL: &str = "replicator-e2e/location";
/// Karmada's namespace label that keeps a hub namespace from being pushed to every member. The
/// members have no namespace controller, so a namespace Karmada pushed and later withdrew would
/// stay Terminating there forever.
pub const KARMADA_SKIP_PROPAGATION_LABEL: &str = "namespace.karmada.io/skip-auto-propagation";
/// The field manager of everything the harness applies.
const FIELD_MANAGER: &str = "replicator-e2e";
/// Requested lifetime of the tokens.
const TOKEN_LIFETIME: &str = "24h";
/// Tokens older than this are issued again (half their lifetime: a scenario never sees one expire).
const REISSUE_AFTER: Duration = Duration::from_secs(12 * 3600);
/// How long a fresh RoleBinding may take to reach the authorizer.
const AUTHORIZED_DEADLINE: Duration = Duration::from_secs(30);

/// The hub service account of `replicator run` for `location`: `replicator-<location>`, the
/// name the admission policy `replicator-location` reads the location from.
pub fn hub_service_account(location: &str) -> String {
    format!("replicator-{location}")
}

/// The least-privilege kubeconfigs of the environment (see the module documentation).
#[derive(Debug, Clone)]
pub struct Identities {
    dir: PathBuf,
}

/// One identity: which cluster, which service account, which file.
#[derive(Debug, Clone, Copy)]
struct Account {
    cluster: Cluster,
    /// The service account name of the shipped manifests.
    service_account: &'static str,
    /// Whether the harness's render suffixes it with `-`[`NAME_SUFFIX`] (in the cells).
    suffixed: bool,
    /// The file stem of its kubeconfig and token.
    file: &'static str,
    /// A request its role must allow: `(group, resource, verb)`, to know the binding is in force.
    probe: (&'static str, &'static str, &'static str),
}

impl Account {
    /// The name of the service account as the harness applies it.
    fn name(&self) -> String {
        if self.suffixed {
            format!("{}-{NAME_SUFFIX}", self.service_account)
        } else {
            self.service_account.to_owned()
        }
    }
}

const ACCOUNTS: [Account; 3] = [
    Account {
        cluster: Cluster::CellA,
        service_account: "replicator",
        suffixed: true,
        file: "cell-a-replicator",
        probe: ("discovery.k8s.io", "endpointslices", "watch"),
    },
    Account {
        cluster: Cluster::CellB,
        service_account: "replicator",
        suffixed: true,
        file: "cell-b-replicator",
        probe: ("discovery.k8s.io", "endpointslices", "watch"),
    },
    Account {
        cluster: Cluster::Hub,
        service_account: "replicator-membership",
        suffixed: false,
        file: "hub-replicator-membership",
        probe: ("networking.datumapis.com", "networkservices", "watch"),
    },
];

/// What was applied and when the tokens were issued.
#[derive(Debug, Serialize, Deserialize)]
struct Stamp {
    digest: String,
    issued_unix: u64,
}

impl Identities {
    /// The kubeconfig of `replicator run` in `cell` (service account `replicator-e2e` of the
    /// cell, bound to the ClusterRole rendered from `config/rbac/cell`).
    ///
    /// # Errors
    /// [`Error::Config`] for a cluster that is not a cell.
    pub fn cell_kubeconfig(&self, cell: Cluster) -> Result<PathBuf> {
        let account = ACCOUNTS
            .iter()
            .find(|a| a.cluster == cell && a.cluster.is_cell())
            .ok_or_else(|| Error::Config(format!("{cell} is not a cell: no replicator identity there")))?;
        Ok(self.kubeconfig(account))
    }

    /// The kubeconfig of `replicator run --location <location>` on the hub: service account
    /// `replicator-<location>` in [`NAMESPACE`], bound as `config/rbac/hub/location` binds a
    /// location's identity (to the harness's ClusterRole `replicator-hub-e2e` and Role
    /// `replicator-lease`), so the admission policies hold it to that location's copies and
    /// Lease. Created on the first call for a location (see the module documentation: an
    /// environment fixture, never removed by a scenario); cheap after the first call of a
    /// process.
    ///
    /// # Errors
    /// [`Error::Config`] for a location that is not a DNS label (or is `membership`, whose
    /// account is membership's); a render, apply or token request that fails, or a binding that
    /// never takes effect.
    pub async fn hub_kubeconfig_for(&self, env: &Environment, location: &str) -> Result<PathBuf> {
        static READY: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
        validate_location(location)?;
        let kubeconfig = self.location_kubeconfig(location);
        let ready = READY.get_or_init(Mutex::default);
        if ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&kubeconfig)
        {
            return Ok(kubeconfig);
        }
        self.ensure_location(env, location).await?;
        ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(kubeconfig.clone());
        Ok(kubeconfig)
    }

    /// The kubeconfig of `replicator membership` on the hub (service account
    /// `replicator-membership` in [`NAMESPACE`], bound to the rendered `replicator-membership-e2e`
    /// ClusterRole).
    pub fn membership_kubeconfig(&self) -> PathBuf {
        self.kubeconfig(&ACCOUNTS[2])
    }

    /// Writes to `path` a kubeconfig for `replicator run` in `cell` that reaches the cell at
    /// `server` instead (for example through a fault proxy), with the same token and CA.
    ///
    /// # Errors
    /// As [`Identities::cell_kubeconfig`], or when the token cannot be read or the file written.
    pub async fn write_cell_kubeconfig_via(
        &self,
        env: &Environment,
        cell: Cluster,
        server: &str,
        path: &Path,
    ) -> Result<()> {
        let source = self.cell_kubeconfig(cell)?;
        let token_path = source.with_extension("token");
        let token =
            std::fs::read_to_string(&token_path).map_err(io_context(format!("reading {}", token_path.display())))?;
        write_token_kubeconfig(env, cell, server, token.trim(), path).await
    }

    fn kubeconfig(&self, account: &Account) -> PathBuf {
        self.dir.join(format!("{}.kubeconfig", account.file))
    }

    fn location_kubeconfig(&self, location: &str) -> PathBuf {
        self.dir.join("locations").join(format!("{location}.kubeconfig"))
    }

    /// Creates or refreshes the hub identity of `location` (see [`Identities::hub_kubeconfig_for`]).
    async fn ensure_location(&self, env: &Environment, location: &str) -> Result<()> {
        let dir = self.dir.join("locations");
        std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        let _lock = lock_dir(&self.dir).await?;
        let account = hub_service_account(location);
        let objects = render_location_identity(env, &self.dir.join("render"), location, NAMESPACE, NAME_SUFFIX).await?;
        if !objects
            .iter()
            .any(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == account.as_str())
        {
            return Err(Error::Config(format!(
                "config/rbac/hub/location renders no ServiceAccount {account} for location {location}"
            )));
        }
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects}).to_string();
        let digest = digest([list.as_str(), &env.server_url(Cluster::Hub)]);
        let kubeconfig = self.location_kubeconfig(location);
        let stamp_path = dir.join(format!("{location}.stamp.json"));
        let user = format!("system:serviceaccount:{NAMESPACE}:{account}");
        if stamp_current(&stamp_path, &digest) && whoami(&kubeconfig).await.is_ok_and(|u| u == user) {
            return Ok(());
        }
        tracing::info!(
            location,
            account,
            namespace = NAMESPACE,
            "creating a location's hub identity"
        );
        let file = dir.join(format!("{location}.json"));
        std::fs::write(&file, &list).map_err(io_context(format!("writing {}", file.display())))?;
        env.ensure_namespace(Cluster::Hub, NAMESPACE).await?;
        apply_file(env, Cluster::Hub, &file).await?;
        let issued_unix = unix_now();
        let token = env
            .service_account_token(Cluster::Hub, NAMESPACE, &account, TOKEN_LIFETIME)
            .await?;
        write_private(&kubeconfig.with_extension("token"), &token)?;
        write_token_kubeconfig(env, Cluster::Hub, &env.server_url(Cluster::Hub), &token, &kubeconfig).await?;
        // The ClusterRoleBinding (copies) and the RoleBinding (the Lease) in force.
        wait_authorized(
            &kubeconfig,
            &account,
            ("discovery.k8s.io", "endpointslices", "patch"),
            None,
        )
        .await?;
        wait_authorized(
            &kubeconfig,
            &account,
            ("coordination.k8s.io", "leases", "create"),
            Some(NAMESPACE),
        )
        .await?;
        write_stamp(&stamp_path, digest, issued_unix)
    }
}

impl Environment {
    /// The least-privilege identities of `replicator run` and `replicator membership` (see the
    /// module documentation), created or refreshed if needed. Cheap after the first call of a
    /// process. The hub identities of the locations are made on demand by
    /// [`Identities::hub_kubeconfig_for`].
    ///
    /// # Errors
    /// A render, apply or token request that fails, or a binding that never takes effect.
    pub async fn least_privilege(&self) -> Result<Identities> {
        static MEMO: OnceLock<Mutex<HashMap<PathBuf, Identities>>> = OnceLock::new();
        let memo = MEMO.get_or_init(Mutex::default);
        let key = self.dir().to_path_buf();
        if let Some(ids) = memo.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key) {
            return Ok(ids.clone());
        }
        let ids = self.ensure_least_privilege().await?;
        memo.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key, ids.clone());
        Ok(ids)
    }

    async fn ensure_least_privilege(&self) -> Result<Identities> {
        let dir = kubeconfig::path(self.dir(), Cluster::Hub)
            .parent()
            .map(|p| p.join("least-privilege"))
            .ok_or_else(|| Error::Config("kubeconfig directory has no parent".into()))?;
        std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        let _lock = lock_dir(&dir).await?;
        let ids = Identities { dir: dir.clone() };
        let work = dir.join("render");
        let cell_yaml = render_wrapped(self, &work, "rbac/cell", NAMESPACE, NAME_SUFFIX, true).await?;
        let hub_yaml = render_hub(self, &work, NAMESPACE, NAME_SUFFIX).await?;
        let servers: Vec<String> = Cluster::ALL.into_iter().map(|c| self.server_url(c)).collect();
        let digest = digest(
            [cell_yaml.as_str(), hub_yaml.as_str()]
                .into_iter()
                .chain(servers.iter().map(String::as_str)),
        );
        let stamp_path = dir.join("stamp.json");
        if self.identities_reusable(&ids, &stamp_path, &digest).await {
            return Ok(ids);
        }
        tracing::info!(
            namespace = NAMESPACE,
            "creating the least-privilege replicator identities"
        );
        let cell_file = dir.join("rbac-cell.yaml");
        let hub_file = dir.join("rbac-hub.yaml");
        std::fs::write(&cell_file, &cell_yaml).map_err(io_context(format!("writing {}", cell_file.display())))?;
        std::fs::write(&hub_file, &hub_yaml).map_err(io_context(format!("writing {}", hub_file.display())))?;
        for (cluster, file) in [
            (Cluster::CellA, &cell_file),
            (Cluster::CellB, &cell_file),
            (Cluster::Hub, &hub_file),
        ] {
            self.ensure_namespace(cluster, NAMESPACE).await?;
            apply_file(self, cluster, file).await?;
        }
        let issued_unix = unix_now();
        for account in &ACCOUNTS {
            let rendered = if account.cluster == Cluster::Hub {
                &hub_yaml
            } else {
                &cell_yaml
            };
            let sa = account.name();
            if !rendered_service_account(rendered, &sa) {
                return Err(Error::Config(format!(
                    "config/{} renders no ServiceAccount {sa}",
                    if account.cluster == Cluster::Hub {
                        "rbac/hub"
                    } else {
                        "rbac/cell"
                    }
                )));
            }
            let token = self
                .service_account_token(account.cluster, NAMESPACE, &sa, TOKEN_LIFETIME)
                .await?;
            let kubeconfig = ids.kubeconfig(account);
            write_private(&kubeconfig.with_extension("token"), &token)?;
            write_token_kubeconfig(
                self,
                account.cluster,
                &self.server_url(account.cluster),
                &token,
                &kubeconfig,
            )
            .await?;
        }
        for account in &ACCOUNTS {
            wait_authorized(&ids.kubeconfig(account), account.file, account.probe, None).await?;
        }
        write_stamp(&stamp_path, digest, issued_unix)?;
        Ok(ids)
    }

    /// Whether the identities recorded in `stamp` match `digest`, are young and authenticate.
    async fn identities_reusable(&self, ids: &Identities, stamp: &Path, digest: &str) -> bool {
        if !stamp_current(stamp, digest) {
            return false;
        }
        for account in &ACCOUNTS {
            let expected = format!("system:serviceaccount:{NAMESPACE}:{}", account.name());
            match whoami(&ids.kubeconfig(account)).await {
                Ok(user) if user == expected => {}
                other => {
                    tracing::info!(
                        file = account.file,
                        ?other,
                        "least-privilege kubeconfig no longer valid"
                    );
                    return false;
                }
            }
        }
        true
    }

    /// Creates namespace `name` in `cluster` unless it exists, labelled so that Karmada does not
    /// push it from the hub to the members.
    ///
    /// # Errors
    /// Any API error other than AlreadyExists.
    pub async fn ensure_namespace(&self, cluster: Cluster, name: &str) -> Result<()> {
        let api = Api::<Namespace>::all(self.client(cluster).await?);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(BTreeMap::from([(
                    KARMADA_SKIP_PROPAGATION_LABEL.to_owned(),
                    "true".to_owned(),
                )])),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A token of service account `namespace/name` in `cluster` (`kubectl create token`, a
    /// TokenRequest), valid for `duration` (for example `2h`).
    ///
    /// # Errors
    /// When kubectl fails (for example the service account does not exist).
    pub async fn service_account_token(
        &self,
        cluster: Cluster,
        namespace: &str,
        name: &str,
        duration: &str,
    ) -> Result<String> {
        let out = self
            .kubectl_ok(
                cluster,
                [
                    "-n",
                    namespace,
                    "create",
                    "token",
                    name,
                    &format!("--duration={duration}"),
                ],
            )
            .await?;
        Ok(out.trim().to_owned())
    }
}

/// Writes a kubeconfig for `cluster` at `server` authenticating with `token`, with the
/// environment's CA embedded; readable only by its owner.
///
/// # Errors
/// When the CA cannot be read or the file written.
pub async fn write_token_kubeconfig(
    env: &Environment,
    cluster: Cluster,
    server: &str,
    token: &str,
    path: &Path,
) -> Result<()> {
    let ca = env.pki().ca_pem().await?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_context(format!("creating {}", parent.display())))?;
    }
    write_private(path, &kubeconfig::render(cluster, server, &ca, "token", token.trim()))
}

/// Renders `config/<target>` through a wrapper kustomization written under `work`, which does
/// what an operator's overlay would: `namespace:` and `nameSuffix: -<suffix>` (kustomize keeps
/// references consistent, binding subjects included), and, with `drop_namespaces`, deletes the
/// Namespace objects. Returns the rendered YAML.
///
/// # Errors
/// When the wrapper cannot be written or `kubectl kustomize` fails.
pub async fn render_wrapped(
    env: &Environment,
    work: &Path,
    target: &str,
    namespace: &str,
    suffix: &str,
    drop_namespaces: bool,
) -> Result<String> {
    let dir = work.join(format!("wrap-{}", target.replace('/', "-")));
    let mut k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\nnamespace: \"{namespace}\"\n\
         nameSuffix: \"-{suffix}\"\n",
        config_relative(&dir, target).display()
    );
    if drop_namespaces {
        k.push_str(DROP_NAMESPACES);
    }
    render_kustomization(env, &dir, &k).await
}

/// The `patches:` entry of a wrapper that deletes every Namespace object of the render.
const DROP_NAMESPACES: &str = "patches:\n- target:\n    kind: Namespace\n  patch: |-\n    $patch: delete\n    \
                               apiVersion: v1\n    kind: Namespace\n    metadata:\n      name: any\n";

/// Renders `config/rbac/hub` as the harness applies it (see the module documentation) with
/// `namespace` = [`NAMESPACE`] and `suffix` = [`NAME_SUFFIX`]: into `namespace`, the names of
/// [`CLUSTER_SCOPED_KINDS`] suffixed with `-<suffix>` (kustomize follows the renames into
/// roleRefs and the policy bindings' `policyName`, which is checked), the service accounts and
/// the namespaced roles as shipped, no Namespace object.
///
/// # Errors
/// When the wrapper cannot be written, `kubectl kustomize` fails, or a reference was not
/// followed.
pub async fn render_hub(env: &Environment, work: &Path, namespace: &str, suffix: &str) -> Result<String> {
    let dir = work.join(format!("wrap-rbac-hub-{suffix}"));
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\nnamespace: \"{namespace}\"\n\
         transformers:\n- |-\n{}{DROP_NAMESPACES}",
        config_relative(&dir, "rbac/hub").display(),
        indent(&suffix_transformer("cluster-scoped", suffix, &CLUSTER_SCOPED_KINDS), 2)
    );
    let yaml = render_kustomization(env, &dir, &k).await?;
    let objects = serde_saphyr::from_multiple::<Value>(&yaml)
        .map_err(|e| Error::Config(format!("parsing the render of config/rbac/hub: {e}")))?;
    let ends = |v: &Value| v.as_str().is_some_and(|n| n.ends_with(&format!("-{suffix}")));
    for o in &objects {
        let kind = o["kind"].as_str().unwrap_or_default();
        let unfollowed = (CLUSTER_SCOPED_KINDS.contains(&kind) && !ends(&o["metadata"]["name"]))
            || (kind == "ClusterRoleBinding" && !ends(&o["roleRef"]["name"]))
            || (kind == "ValidatingAdmissionPolicyBinding" && !ends(&o["spec"]["policyName"]));
        if unfollowed {
            return Err(Error::Config(format!(
                "the harness's render of config/rbac/hub left {kind} {} pointing at a shipped name: {o}",
                o["metadata"]["name"]
            )));
        }
    }
    Ok(yaml)
}

/// The text of a builtin `PrefixSuffixTransformer` that appends `-<suffix>` to the names of
/// objects of `kinds` only (for a wrapper's `transformers:`); kustomize follows the renames into
/// the references it knows (roleRefs, binding subjects, `policyName`).
pub fn suffix_transformer(name: &str, suffix: &str, kinds: &[&str]) -> String {
    let mut text = format!(
        "apiVersion: builtin\nkind: PrefixSuffixTransformer\nmetadata:\n  name: {name}\nsuffix: \"-{suffix}\"\nfieldSpecs:\n"
    );
    for kind in kinds {
        text.push_str(&format!("- kind: {kind}\n  path: metadata/name\n"));
    }
    text
}

/// `text` with every line indented by `by` spaces (a block scalar inside a kustomization).
fn indent(text: &str, by: usize) -> String {
    text.lines().map(|l| format!("{:by$}{l}\n", "")).collect()
}

/// Renders the hub identity of `location` the way `config/overlays/<location>/hub` does
/// (`config/rbac/hub/location` with `nameSuffix: -<location>`), moved into `namespace` and
/// labelled [`LOCATION_IDENTITY_LABEL`]; then, as [`render_hub`] names the cluster-scoped
/// objects, appends `-<suffix>` to the ClusterRoleBinding names (`replicator-hub-<location>-e2e`
/// for the harness: never a shipped overlay's) and to the ClusterRoles they bind
/// (`replicator-hub-e2e`). The RoleBinding binds the Role `replicator-lease` of `namespace`.
/// The harness's identities use [`NAMESPACE`] and [`NAME_SUFFIX`]. Returns the objects.
///
/// # Errors
/// A location that is not a DNS label, a wrapper that cannot be written, a failed render.
pub async fn render_location_identity(
    env: &Environment,
    work: &Path,
    location: &str,
    namespace: &str,
    suffix: &str,
) -> Result<Vec<Value>> {
    validate_location(location)?;
    let dir = work.join(format!("location-{location}-{suffix}"));
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\nnamespace: \"{namespace}\"\n\
         nameSuffix: \"-{location}\"\nlabels:\n- pairs:\n    {LOCATION_IDENTITY_LABEL}: \"true\"\n    \
         {LOCATION_IDENTITY_LOCATION_LABEL}: \"{location}\"\n",
        config_relative(&dir, "rbac/hub/location").display()
    );
    let yaml = render_kustomization(env, &dir, &k).await?;
    let mut objects = serde_saphyr::from_multiple::<Value>(&yaml)
        .map_err(|e| Error::Config(format!("parsing the render of config/rbac/hub/location: {e}")))?;
    for o in &mut objects {
        if o["kind"].as_str().is_some_and(|k| CLUSTER_SCOPED_KINDS.contains(&k)) {
            suffix_field(&mut o["metadata"]["name"], suffix);
        }
        if o["kind"] == "ClusterRoleBinding" && o["roleRef"]["kind"] == "ClusterRole" {
            suffix_field(&mut o["roleRef"]["name"], suffix);
        }
    }
    Ok(objects)
}

fn suffix_field(field: &mut Value, suffix: &str) {
    if let Some(name) = field.as_str() {
        *field = Value::String(format!("{name}-{suffix}"));
    }
}

/// Refuses a location that cannot name a hub identity: not a DNS label, or `membership`
/// (`replicator-membership` is membership's account).
///
/// # Errors
/// [`Error::Config`] naming the location.
pub fn validate_location(location: &str) -> Result<()> {
    let label = !location.is_empty()
        && location.len() <= 63
        && location
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !location.starts_with('-')
        && !location.ends_with('-');
    if !label || location == "membership" {
        return Err(Error::Config(format!(
            "location {location:?} cannot name a hub identity replicator-<location>: a DNS label other than \
             `membership` is needed"
        )));
    }
    Ok(())
}

/// `config/<target>` relative to the directory `dir` (kustomize refuses absolute resource
/// paths: climb from `dir` to / and back down).
pub fn config_relative(dir: &Path, target: &str) -> PathBuf {
    let ups = dir.components().filter(|c| matches!(c, Component::Normal(_))).count();
    let mut rel = PathBuf::new();
    for _ in 0..ups {
        rel.push("..");
    }
    let config = paths::workspace_root().join("config").join(target);
    rel.join(config.strip_prefix("/").unwrap_or(&config))
}

/// Writes `text` as `dir/kustomization.yaml` and returns `kubectl kustomize dir`.
async fn render_kustomization(env: &Environment, dir: &Path, text: &str) -> Result<String> {
    std::fs::create_dir_all(dir).map_err(io_context(format!("creating {}", dir.display())))?;
    let file = dir.join("kustomization.yaml");
    std::fs::write(&file, text).map_err(io_context(format!("writing {}", file.display())))?;
    env.kubectl_ok(Cluster::Hub, [OsString::from("kustomize"), dir.as_os_str().to_owned()])
        .await
}

/// `kubectl apply --server-side --force-conflicts` of `file` to `cluster`, as the harness's
/// field manager.
async fn apply_file(env: &Environment, cluster: Cluster, file: &Path) -> Result<()> {
    let mut args: Vec<OsString> = ["apply", "--server-side", "--force-conflicts"]
        .map(OsString::from)
        .to_vec();
    args.push(format!("--field-manager={FIELD_MANAGER}").into());
    args.extend(["-f".into(), file.as_os_str().to_owned()]);
    env.kubectl_ok(cluster, args).await.map(drop)
}

/// The SHA-256 of `parts` (each followed by a NUL), in hex.
fn digest<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the stamp at `path` records `digest` and a token young enough to reuse.
fn stamp_current(path: &Path, digest: &str) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    let Ok(stamp) = serde_json::from_str::<Stamp>(&text) else {
        return false;
    };
    stamp.digest == digest && unix_now().saturating_sub(stamp.issued_unix) <= REISSUE_AFTER.as_secs()
}

fn write_stamp(path: &Path, digest: String, issued_unix: u64) -> Result<()> {
    let stamp = Stamp { digest, issued_unix };
    let text = serde_json::to_string(&stamp).map_err(|source| Error::State {
        path: path.to_path_buf(),
        source,
    })?;
    write_private(path, &text)
}

/// Whether `yaml` holds a ServiceAccount named `name`.
fn rendered_service_account(yaml: &str, name: &str) -> bool {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap_or_default()
        .iter()
        .any(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == name)
}

/// The user name the kubeconfig at `path` authenticates as (SelfSubjectReview).
async fn whoami(path: &Path) -> Result<String> {
    let api = Api::<SelfSubjectReview>::all(crate::kubeconfig::client(path).await?);
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    Ok(review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default())
}

/// Waits until `probe` (`(group, resource, verb)`, in `namespace` or cluster-wide) is allowed to
/// the identity of the kubeconfig at `path` (a new binding reaches the authorizer through an
/// informer). `who` names the identity in a timeout.
async fn wait_authorized(path: &Path, who: &str, probe: (&str, &str, &str), namespace: Option<&str>) -> Result<()> {
    let api = Api::<SelfSubjectAccessReview>::all(crate::kubeconfig::client(path).await?);
    let (group, resource, verb) = probe;
    let what = format!(
        "{who} to be allowed to {verb} {group}/{resource}{}",
        namespace.map(|ns| format!(" in {ns}")).unwrap_or_default()
    );
    wait::until_observed(AUTHORIZED_DEADLINE, &what, || {
        let api = api.clone();
        async move {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(group.to_owned()),
                        resource: Some(resource.to_owned()),
                        verb: Some(verb.to_owned()),
                        namespace: namespace.map(str::to_owned),
                        ..ResourceAttributes::default()
                    }),
                    ..SelfSubjectAccessReviewSpec::default()
                },
                ..SelfSubjectAccessReview::default()
            };
            let allowed = api
                .create(&PostParams::default(), &review)
                .await?
                .status
                .is_some_and(|s| s.allowed);
            Ok::<_, kube::Error>(if allowed {
                Check::Ready(())
            } else {
                Check::NotYet("not allowed yet".to_owned())
            })
        }
    })
    .await
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_names_a_hub_identity_only_as_a_dns_label() {
        for good in ["dfw", "loc-1a2b3c", "a", &"x".repeat(63)] {
            assert!(validate_location(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", "membership", &"x".repeat(64)] {
            assert!(validate_location(bad).is_err(), "{bad}");
        }
        assert_eq!(hub_service_account("dfw"), "replicator-dfw");
    }

    #[test]
    fn the_suffix_transformer_renames_only_the_kinds_given() {
        assert_eq!(
            suffix_transformer("t", "e2e", &["ClusterRole", "ValidatingAdmissionPolicy"]),
            "apiVersion: builtin\nkind: PrefixSuffixTransformer\nmetadata:\n  name: t\nsuffix: \"-e2e\"\nfieldSpecs:\n\
             - kind: ClusterRole\n  path: metadata/name\n- kind: ValidatingAdmissionPolicy\n  path: metadata/name\n"
        );
    }
}
