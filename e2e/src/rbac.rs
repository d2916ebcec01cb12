//! Least-privilege identities for the `replicator` processes the scenarios run, and the pieces
//! for applying `config/` manifests to the environment (wrapper kustomizations, service-account
//! tokens, token kubeconfigs).
//!
//! By default [`crate::ReplicatorProcess::spawn`] runs `replicator run` with a token of a service
//! account bound to exactly the ClusterRole rendered from `config/rbac/cell` (in its cell) and
//! the one rendered from `config/rbac/hub` (on the hub), and `replicator membership` with the
//! hub's membership account: every scenario exercises the shipped RBAC, and a verb missing from
//! it fails the scenario. The manifests are rendered through a wrapper kustomization that only
//! moves them into namespace [`NAMESPACE`] and suffixes every name with `-`[`NAME_SUFFIX`] (the
//! rules are untouched), so a test that applies the manifests as shipped (`replicator-system`)
//! and cleans them up never pulls these identities from under the other scenarios.
//!
//! [`Environment::least_privilege`] creates them once per environment, idempotently: `kubectl
//! apply --server-side` of the render, then `kubectl create token`. The kubeconfigs live in
//! `<state>/kubeconfigs/least-privilege/`, beside a stamp with the digest of what was applied and
//! when the tokens were issued; later calls reuse them while the stamp matches, the tokens are
//! young and they still authenticate.

use std::collections::{BTreeMap, HashMap};
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
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::cluster::Cluster;
use crate::controlplane::{Environment, lock_dir, write_private};
use crate::error::{Error, Result, io_context};
use crate::kubeconfig;
use crate::paths;
use crate::wait::{self, Check};

/// The namespace of the harness's service accounts (in the hub and in both cells).
pub const NAMESPACE: &str = "replicator-e2e";
/// The suffix the wrapper kustomization appends to every rendered name (`replicator-e2e`,
/// `replicator-cell-e2e`, ...).
pub const NAME_SUFFIX: &str = "e2e";
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

/// The least-privilege kubeconfigs of the environment (see the module documentation).
#[derive(Debug, Clone)]
pub struct Identities {
    dir: PathBuf,
}

/// One identity: which cluster, which service account, which file.
#[derive(Debug, Clone, Copy)]
struct Account {
    cluster: Cluster,
    /// The unsuffixed service account name of the shipped manifests.
    service_account: &'static str,
    /// The file stem of its kubeconfig and token.
    file: &'static str,
    /// A request its role must allow: `(group, resource, verb)`, to know the binding is in force.
    probe: (&'static str, &'static str, &'static str),
}

const ACCOUNTS: [Account; 4] = [
    Account {
        cluster: Cluster::CellA,
        service_account: "replicator",
        file: "cell-a-replicator",
        probe: ("discovery.k8s.io", "endpointslices", "watch"),
    },
    Account {
        cluster: Cluster::CellB,
        service_account: "replicator",
        file: "cell-b-replicator",
        probe: ("discovery.k8s.io", "endpointslices", "watch"),
    },
    Account {
        cluster: Cluster::Hub,
        service_account: "replicator",
        file: "hub-replicator",
        probe: ("discovery.k8s.io", "endpointslices", "patch"),
    },
    Account {
        cluster: Cluster::Hub,
        service_account: "replicator-membership",
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

    /// The kubeconfig of `replicator run` on the hub (service account `replicator-e2e`, bound
    /// to the ClusterRole `replicator-hub` rendered from `config/rbac/hub`).
    pub fn hub_kubeconfig(&self) -> PathBuf {
        self.kubeconfig(&ACCOUNTS[2])
    }

    /// The kubeconfig of `replicator membership` on the hub (service account
    /// `replicator-membership-e2e`, bound to the rendered `replicator-membership` ClusterRole).
    pub fn membership_kubeconfig(&self) -> PathBuf {
        self.kubeconfig(&ACCOUNTS[3])
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
}

impl Environment {
    /// The least-privilege identities of `replicator run` and `replicator membership` (see the
    /// module documentation), created or refreshed if needed. Cheap after the first call of a
    /// process.
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
        let hub_yaml = render_wrapped(self, &work, "rbac/hub", NAMESPACE, NAME_SUFFIX, true).await?;
        let digest = {
            let mut h = Sha256::new();
            for part in [&cell_yaml, &hub_yaml] {
                h.update(part.as_bytes());
                h.update([0]);
            }
            for cluster in Cluster::ALL {
                h.update(self.server_url(cluster).as_bytes());
            }
            h.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
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
            let mut args: Vec<OsString> = ["apply", "--server-side", "--force-conflicts"]
                .map(OsString::from)
                .to_vec();
            args.push(format!("--field-manager={FIELD_MANAGER}").into());
            args.extend(["-f".into(), file.as_os_str().to_owned()]);
            self.kubectl_ok(cluster, args).await?;
        }
        let issued_unix = unix_now();
        for account in &ACCOUNTS {
            let rendered = if account.cluster == Cluster::Hub {
                &hub_yaml
            } else {
                &cell_yaml
            };
            let sa = format!("{}-{NAME_SUFFIX}", account.service_account);
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
            wait_authorized(&ids.kubeconfig(account), account).await?;
        }
        let stamp = Stamp { digest, issued_unix };
        let text = serde_json::to_string(&stamp).map_err(|source| Error::State {
            path: stamp_path.clone(),
            source,
        })?;
        write_private(&stamp_path, &text)?;
        Ok(ids)
    }

    /// Whether the identities recorded in `stamp` match `digest`, are young and authenticate.
    async fn identities_reusable(&self, ids: &Identities, stamp: &Path, digest: &str) -> bool {
        let Ok(text) = std::fs::read_to_string(stamp) else {
            return false;
        };
        let Ok(stamp) = serde_json::from_str::<Stamp>(&text) else {
            return false;
        };
        if stamp.digest != digest || unix_now().saturating_sub(stamp.issued_unix) > REISSUE_AFTER.as_secs() {
            return false;
        }
        for account in &ACCOUNTS {
            let expected = format!(
                "system:serviceaccount:{NAMESPACE}:{}-{NAME_SUFFIX}",
                account.service_account
            );
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
    std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
    // kustomize refuses absolute resource paths: climb from the wrapper to / and back down.
    let ups = dir.components().filter(|c| matches!(c, Component::Normal(_))).count();
    let mut rel = PathBuf::new();
    for _ in 0..ups {
        rel.push("..");
    }
    let config = paths::workspace_root().join("config").join(target);
    let rel = rel.join(config.strip_prefix("/").unwrap_or(&config));
    let mut k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\nnamespace: \"{namespace}\"\n\
         nameSuffix: \"-{suffix}\"\n",
        rel.display()
    );
    if drop_namespaces {
        k.push_str(
            "patches:\n- target:\n    kind: Namespace\n  patch: |-\n    $patch: delete\n    apiVersion: v1\n    \
             kind: Namespace\n    metadata:\n      name: any\n",
        );
    }
    let file = dir.join("kustomization.yaml");
    std::fs::write(&file, k).map_err(io_context(format!("writing {}", file.display())))?;
    env.kubectl_ok(Cluster::Hub, [OsString::from("kustomize"), dir.into_os_string()])
        .await
}

/// Whether `yaml` holds a ServiceAccount named `name`.
fn rendered_service_account(yaml: &str, name: &str) -> bool {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap_or_default()
        .iter()
        .any(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == name)
}

async fn client_from(path: &Path) -> Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// The user name the kubeconfig at `path` authenticates as (SelfSubjectReview).
async fn whoami(path: &Path) -> Result<String> {
    let api = Api::<SelfSubjectReview>::all(client_from(path).await?);
    let review = api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    Ok(review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .unwrap_or_default())
}

/// Waits until the account's probe request is allowed (a new binding reaches the authorizer
/// through an informer).
async fn wait_authorized(path: &Path, account: &Account) -> Result<()> {
    let api = Api::<SelfSubjectAccessReview>::all(client_from(path).await?);
    let (group, resource, verb) = account.probe;
    let what = format!("{} to be allowed to {verb} {group}/{resource}", account.file);
    wait::until_observed(AUTHORIZED_DEADLINE, &what, || {
        let api = api.clone();
        async move {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(group.to_owned()),
                        resource: Some(resource.to_owned()),
                        verb: Some(verb.to_owned()),
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
