//! Karmada in the loop: the hub kube-apiserver is the Karmada apiserver, next to it run
//! karmada-aggregated-apiserver, karmada-webhook, karmada-controller-manager and
//! karmada-scheduler, and cell-a, cell-b and edge-1 are registered as push-mode members.
//!
//! The recipe in the order [`Environment`] runs it:
//!
//! 1. namespaces `karmada-system` and `karmada-cluster`, Karmada's CRDs (the `_crds/bases`
//!    copied by the build script, without the kustomization's conversion webhook);
//! 2. karmada-aggregated-apiserver, the APIService `v1alpha1.cluster.karmada.io` and an
//!    `ExternalName` Service pointing at `localhost` (no cluster network needed), until the
//!    APIService is Available;
//! 3. karmada-webhook with a serving certificate from the environment's CA, and Karmada's webhook
//!    configurations rewritten to `https://127.0.0.1:<port>/...` with that CA as `caBundle`;
//! 4. kube-controller-manager (namespace, garbage collector), karmada-controller-manager and
//!    karmada-scheduler;
//! 5. one Secret (admin bearer token, CA) and one `Cluster` (push mode) per member, labelled
//!    with `topology.datum.net/location` (cells) and `infra.datum.net/gateways=enabled` (all),
//!    until every `Cluster` is Ready and untainted.
//!
//! The waits for later scenarios are here too: [`Environment::wait_on_member`] and friends.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use futures::future::try_join_all;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service, ServicePort, ServiceSpec};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::{APIService, APIServiceSpec, ServiceReference};
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::cluster::Cluster;
use crate::controlplane::{Environment, MemberStatus};
use crate::crds;
use crate::daemon::Daemon;
use crate::error::{Error, Result, io_context};
use crate::files::{flag, write_private};
use crate::kubeconfig;
use crate::wait::{self, Check};

/// Karmada's system namespace (the aggregated apiserver's Service lives here).
pub const KARMADA_SYSTEM_NAMESPACE: &str = "karmada-system";
/// The namespace of the member clusters' credentials.
pub const KARMADA_CLUSTER_NAMESPACE: &str = "karmada-cluster";
/// The APIService through which the hub serves `cluster.karmada.io/v1alpha1`.
pub const CLUSTER_APISERVICE: &str = "v1alpha1.cluster.karmada.io";
/// The label carrying a cell's location on its Karmada `Cluster`.
pub const LOCATION_LABEL: &str = "topology.datum.net/location";
/// The label marking a Karmada `Cluster` as a gateway cluster.
pub const GATEWAYS_LABEL: &str = "infra.datum.net/gateways";
/// The value of [`GATEWAYS_LABEL`] on every member.
pub const GATEWAYS_ENABLED: &str = "enabled";
/// The controllers karmada-controller-manager runs (karmada.md §2.7): enough for
/// policy → binding → Work → member, status collection and namespace propagation.
pub const KARMADA_CONTROLLERS: &str = "cluster,clusterStatus,binding,bindingStatus,execution,workStatus,namespace";
/// The client-side rate limit (requests per second) of karmada-controller-manager towards the
/// hub and the members, and of karmada-scheduler towards the hub. Upstream's default, 40 (burst
/// 60), protects a shared production apiserver; on this one-host environment it dominates every
/// latency: 200 ConfigMaps at 10/s took p50 62 s, p99 100 s to reach the members with it, and
/// p50 1.3 s, p99 2.9 s with this limit (`karmada-propagation`).
pub const KARMADA_CLIENT_QPS: &str = "500";
/// The client-side burst that goes with [`KARMADA_CLIENT_QPS`].
pub const KARMADA_CLIENT_BURST: &str = "1000";

/// The Service name the APIService points at.
const AGGREGATED_APISERVER_SERVICE: &str = "karmada-aggregated-apiserver";
/// The host in the upstream webhook configuration's URLs, replaced by `127.0.0.1:<port>`.
const UPSTREAM_WEBHOOK_HOST: &str = "karmada-webhook.karmada-system.svc:443";
/// The upstream webhook configuration's CA placeholder.
const CA_BUNDLE_PLACEHOLDER: &str = "{{caBundle}}";
/// Field manager of the objects the harness writes.
const FIELD_MANAGER: &str = "replicator-e2e";
/// Karmada's taints on a Cluster that is not (yet) schedulable.
const NOT_SCHEDULABLE_TAINTS: [&str; 2] = ["cluster.karmada.io/not-ready", "cluster.karmada.io/unreachable"];

/// How long the APIService may take to become Available.
const APISERVICE_AVAILABLE: Duration = Duration::from_secs(120);
/// How long a Karmada component may take to become healthy.
const KARMADA_COMPONENT_READY: Duration = Duration::from_secs(120);
/// How long the members may take to become Ready after registration.
const MEMBERS_READY: Duration = Duration::from_secs(120);
/// The timeout of one API read made while probing the environment's status.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

/// The API resource of Karmada's `Cluster` (`cluster.karmada.io/v1alpha1`, cluster-scoped,
/// served by the aggregated apiserver through the hub).
pub fn cluster_resource() -> ApiResource {
    karmada_resource("cluster.karmada.io", "Cluster", "clusters")
}

/// The API resource of `ClusterPropagationPolicy` (`policy.karmada.io/v1alpha1`, cluster-scoped).
pub fn cluster_propagation_policy_resource() -> ApiResource {
    karmada_resource(
        "policy.karmada.io",
        "ClusterPropagationPolicy",
        "clusterpropagationpolicies",
    )
}

/// The API resource of `PropagationPolicy` (`policy.karmada.io/v1alpha1`, namespaced).
pub fn propagation_policy_resource() -> ApiResource {
    karmada_resource("policy.karmada.io", "PropagationPolicy", "propagationpolicies")
}

/// The API resource of `ResourceBinding` (`work.karmada.io/v1alpha2`, namespaced).
pub fn resource_binding_resource() -> ApiResource {
    ApiResource {
        group: "work.karmada.io".to_owned(),
        version: "v1alpha2".to_owned(),
        api_version: "work.karmada.io/v1alpha2".to_owned(),
        kind: "ResourceBinding".to_owned(),
        plural: "resourcebindings".to_owned(),
    }
}

fn karmada_resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: format!("{group}/v1alpha1"),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}

/// The labels of a member's Karmada `Cluster`.
pub fn member_labels(member: Cluster) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([(GATEWAYS_LABEL.to_owned(), GATEWAYS_ENABLED.to_owned())]);
    if let Some(location) = member.location() {
        labels.insert(LOCATION_LABEL.to_owned(), location.to_owned());
    }
    labels
}

/// Rewrites Karmada's `webhook-configuration.yaml`: every URL to `https://127.0.0.1:<port>/...`
/// and every `caBundle` to `ca_pem`. Fails if a placeholder is left over.
pub(crate) fn rewrite_webhook_configuration(upstream: &str, port: u16, ca_pem: &[u8]) -> Result<String> {
    if !upstream.contains(UPSTREAM_WEBHOOK_HOST) || !upstream.contains(CA_BUNDLE_PLACEHOLDER) {
        return Err(Error::Config(format!(
            "Karmada's webhook configuration no longer mentions {UPSTREAM_WEBHOOK_HOST} and {CA_BUNDLE_PLACEHOLDER}"
        )));
    }
    let text = upstream
        .replace(UPSTREAM_WEBHOOK_HOST, &format!("127.0.0.1:{port}"))
        .replace(CA_BUNDLE_PLACEHOLDER, &STANDARD.encode(ca_pem));
    if let Some(at) = text.find("{{") {
        let rest: String = text[at..].chars().take(40).collect();
        return Err(Error::Config(format!(
            "Karmada's webhook configuration has a placeholder the harness does not fill: {rest}"
        )));
    }
    Ok(text)
}

/// Ready and schedulable, or what is missing, from a `Cluster` object.
fn member_readiness(cluster: &DynamicObject) -> std::result::Result<(), String> {
    let conditions = cluster.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ready = conditions.iter().find(|condition| condition["type"] == "Ready");
    match ready {
        None => return Err("no Ready condition yet".to_owned()),
        Some(condition) if condition["status"] != "True" => {
            return Err(format!(
                "Ready={} ({}: {})",
                condition["status"].as_str().unwrap_or("?"),
                condition["reason"].as_str().unwrap_or(""),
                condition["message"].as_str().unwrap_or("")
            ));
        }
        Some(_) => {}
    }
    let taints = cluster.data["spec"]["taints"].as_array().cloned().unwrap_or_default();
    let blocking: Vec<&str> = taints
        .iter()
        .filter_map(|taint| taint["key"].as_str())
        .filter(|key| NOT_SCHEDULABLE_TAINTS.contains(key))
        .collect();
    if blocking.is_empty() {
        Ok(())
    } else {
        Err(format!("Ready but still tainted {}", blocking.join(", ")))
    }
}

impl Environment {
    /// A client for the hub authenticated as admin: the Karmada API (policies, bindings,
    /// `Cluster`s) is served there.
    pub async fn karmada_client(&self) -> Result<Client> {
        self.client(Cluster::Hub).await
    }

    /// Waits until `name` (in `namespace`, or cluster-scoped for `None`) exists on `member` and
    /// `ready` holds for it; returns the object. Errors name the object, the member and what
    /// was last seen.
    pub async fn wait_on_member<K>(
        &self,
        member: Cluster,
        namespace: Option<&str>,
        name: &str,
        deadline: Duration,
        ready: impl Fn(&K) -> bool,
    ) -> Result<K>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    {
        let resource = ApiResource::erase::<K>(&());
        let api = dynamic_api(self.client(member).await?, &resource, namespace);
        let what = format!("{} {} on {member}", resource.kind, qualified(namespace, name));
        let ready = |object: &DynamicObject| object.clone().try_parse::<K>().is_ok_and(|typed| ready(&typed));
        let object = wait_for_object(&api, name, deadline, &what, ready).await?;
        object
            .try_parse::<K>()
            .map_err(|error| Error::Scenario(format!("{what}: cannot parse it: {error}")))
    }

    /// Like [`Environment::wait_on_member`] for any kind, given its API resource.
    pub async fn wait_on_member_dynamic(
        &self,
        member: Cluster,
        resource: &ApiResource,
        namespace: Option<&str>,
        name: &str,
        deadline: Duration,
        ready: impl Fn(&DynamicObject) -> bool,
    ) -> Result<DynamicObject> {
        let api = dynamic_api(self.client(member).await?, resource, namespace);
        let what = format!("{} {} on {member}", resource.kind, qualified(namespace, name));
        wait_for_object(&api, name, deadline, &what, ready).await
    }

    /// [`Environment::wait_on_member_dynamic`] on several members at once; returns the objects
    /// in the order of `members`.
    pub async fn wait_on_members_dynamic(
        &self,
        members: &[Cluster],
        resource: &ApiResource,
        namespace: Option<&str>,
        name: &str,
        deadline: Duration,
        ready: impl Fn(&DynamicObject) -> bool + Clone,
    ) -> Result<Vec<DynamicObject>> {
        try_join_all(
            members
                .iter()
                .map(|member| self.wait_on_member_dynamic(*member, resource, namespace, name, deadline, ready.clone())),
        )
        .await
    }

    /// Waits until `name` is gone from `member` (deleted, not merely terminating).
    pub async fn wait_absent_on_member(
        &self,
        member: Cluster,
        resource: &ApiResource,
        namespace: Option<&str>,
        name: &str,
        deadline: Duration,
    ) -> Result<()> {
        let api = dynamic_api(self.client(member).await?, resource, namespace);
        let what = format!(
            "{} {} to be gone from {member}",
            resource.kind,
            qualified(namespace, name)
        );
        wait::until_observed(deadline, &what, || async {
            Ok::<_, kube::Error>(match api.get_opt(name).await? {
                None => Check::Ready(()),
                Some(object) => Check::NotYet(match object.metadata.deletion_timestamp {
                    Some(_) => "still there, terminating".to_owned(),
                    None => "still there".to_owned(),
                }),
            })
        })
        .await
    }

    /// The Karmada `Cluster` of every member as the hub serves it now (no waiting).
    pub async fn member_statuses(&self) -> Vec<MemberStatus> {
        let api = match self.karmada_client().await {
            Ok(client) => Some(Api::<DynamicObject>::all_with(client, &cluster_resource())),
            Err(error) => {
                let problem = format!("no hub client: {error}");
                return Cluster::MEMBERS
                    .into_iter()
                    .map(|cluster| MemberStatus {
                        cluster,
                        ready: Err(problem.clone()),
                    })
                    .collect();
            }
        };
        futures::future::join_all(Cluster::MEMBERS.into_iter().map(|cluster| {
            let api = api.clone();
            async move {
                let ready = match api {
                    None => Err("no hub client".to_owned()),
                    Some(api) => match tokio::time::timeout(STATUS_TIMEOUT, api.get_opt(cluster.name())).await {
                        Err(_elapsed) => Err("the hub did not answer in time".to_owned()),
                        Ok(Err(error)) => Err(format!("reading the Cluster: {error}")),
                        Ok(Ok(None)) => Err("no Cluster object".to_owned()),
                        Ok(Ok(Some(object))) => member_readiness(&object),
                    },
                };
                MemberStatus { cluster, ready }
            }
        }))
        .await
    }

    /// Waits until every member's `Cluster` is Ready and untainted.
    pub async fn wait_members_ready(&self, deadline: Duration) -> Result<()> {
        let api: Api<DynamicObject> = Api::all_with(self.karmada_client().await?, &cluster_resource());
        try_join_all(Cluster::MEMBERS.into_iter().map(|member| {
            let api = api.clone();
            async move {
                let what = format!("Karmada Cluster {member} to be Ready");
                wait::until_observed(deadline, &what, || async {
                    Ok::<_, kube::Error>(match api.get_opt(member.name()).await? {
                        None => Check::NotYet("no Cluster object".to_owned()),
                        Some(object) => match member_readiness(&object) {
                            Ok(()) => Check::Ready(()),
                            Err(problem) => Check::NotYet(problem),
                        },
                    })
                })
                .await
            }
        }))
        .await?;
        Ok(())
    }

    /// Starts Karmada on the running hub and registers the members (steps 1–5 of the module
    /// documentation). kube-controller-manager is started here too, after the aggregated API is
    /// up (its garbage collector's discovery stalls while an APIService is unavailable).
    pub(crate) async fn start_karmada(&self) -> Result<()> {
        self.install_karmada_prerequisites().await?;
        self.start_daemon(Daemon::KarmadaAggregatedApiserver, KARMADA_COMPONENT_READY)
            .await?;
        self.register_aggregated_api().await?;
        self.wait_aggregated_api(APISERVICE_AVAILABLE).await?;
        self.start_daemon(Daemon::KarmadaWebhook, KARMADA_COMPONENT_READY)
            .await?;
        self.install_webhook_configuration().await?;
        try_join_all(
            [
                Daemon::KubeControllerManager,
                Daemon::KarmadaControllerManager,
                Daemon::KarmadaScheduler,
            ]
            .map(|daemon| self.start_daemon(daemon, KARMADA_COMPONENT_READY)),
        )
        .await?;
        self.register_members().await?;
        self.wait_members_ready(MEMBERS_READY)
            .await
            .map_err(|reason| self.daemon_error(Daemon::KarmadaControllerManager, reason))?;
        Ok(())
    }

    /// Restarts the processes that watch the hub (see [`Environment::start_apiserver`]): the
    /// webhook first (the controllers' writes pass through it), then the controllers.
    pub(crate) async fn restart_hub_watchers(&self) -> Result<()> {
        tracing::info!("hub restarted: restarting the processes that watch it, so that they resync at once");
        self.stop_daemon(Daemon::KarmadaWebhook).await?;
        self.start_daemon(Daemon::KarmadaWebhook, KARMADA_COMPONENT_READY)
            .await?;
        let controllers = [
            Daemon::KubeControllerManager,
            Daemon::KarmadaControllerManager,
            Daemon::KarmadaScheduler,
        ];
        try_join_all(controllers.map(|daemon| async move {
            self.stop_daemon(daemon).await?;
            self.start_daemon(daemon, KARMADA_COMPONENT_READY).await
        }))
        .await?;
        Ok(())
    }

    /// The command line of a daemon.
    pub(crate) fn daemon_args(&self, daemon: Daemon) -> Vec<std::ffi::OsString> {
        let karmada_kubeconfig = kubeconfig::karmada_path(&self.dir);
        let on = |port: u16| format!("127.0.0.1:{port}");
        let serving = self.pki.apiserver_cert();
        match daemon {
            Daemon::KubeControllerManager => vec![
                flag("--kubeconfig", kubeconfig::controller_manager_path(&self.dir)),
                flag("--controllers", "namespace,garbagecollector"),
                flag("--leader-elect", "false"),
                flag("--bind-address", "127.0.0.1"),
                flag("--secure-port", self.ports.controller_manager.to_string()),
                flag("--tls-cert-file", &serving.cert),
                flag("--tls-private-key-file", &serving.key),
            ],
            Daemon::KarmadaAggregatedApiserver => vec![
                flag("--kubeconfig", &karmada_kubeconfig),
                flag("--authentication-kubeconfig", &karmada_kubeconfig),
                flag("--authorization-kubeconfig", &karmada_kubeconfig),
                flag("--etcd-servers", self.etcd_url()),
                // The hub's prefix: Cluster objects are hub data (`/hub/cluster.karmada.io/...`).
                flag("--etcd-prefix", Cluster::Hub.etcd_prefix()),
                // One compactor for the shared etcd is enough (the hub apiserver's).
                flag("--etcd-compaction-interval", "0"),
                flag("--bind-address", "127.0.0.1"),
                flag("--secure-port", self.ports.karmada_aggregated_apiserver.to_string()),
                flag(
                    "--cert-dir",
                    self.pki.dir().join(Daemon::KarmadaAggregatedApiserver.name()),
                ),
                flag("--tls-cert-file", &serving.cert),
                flag("--tls-private-key-file", &serving.key),
            ],
            Daemon::KarmadaWebhook => {
                let cert = self.pki.karmada_webhook_cert();
                vec![
                    flag("--kubeconfig", &karmada_kubeconfig),
                    flag("--bind-address", "127.0.0.1"),
                    flag("--secure-port", self.ports.karmada_webhook.to_string()),
                    flag("--cert-dir", self.pki.dir()),
                    flag("--tls-cert-file-name", file_name(&cert.cert)),
                    flag("--tls-private-key-file-name", file_name(&cert.key)),
                    flag("--metrics-bind-address", on(self.ports.karmada_webhook_metrics)),
                    flag("--health-probe-bind-address", on(self.ports.karmada_webhook_health)),
                ]
            }
            Daemon::KarmadaControllerManager => vec![
                flag("--kubeconfig", &karmada_kubeconfig),
                flag("--leader-elect", "false"),
                flag("--controllers", KARMADA_CONTROLLERS),
                flag("--enable-cluster-resource-modeling", "false"),
                flag("--kube-api-qps", KARMADA_CLIENT_QPS),
                flag("--kube-api-burst", KARMADA_CLIENT_BURST),
                flag("--cluster-api-qps", KARMADA_CLIENT_QPS),
                flag("--cluster-api-burst", KARMADA_CLIENT_BURST),
                flag(
                    "--metrics-bind-address",
                    on(self.ports.karmada_controller_manager_metrics),
                ),
                flag(
                    "--health-probe-bind-address",
                    on(self.ports.karmada_controller_manager_health),
                ),
            ],
            Daemon::KarmadaScheduler => vec![
                flag("--kubeconfig", &karmada_kubeconfig),
                flag("--leader-elect", "false"),
                flag("--kube-api-qps", KARMADA_CLIENT_QPS),
                flag("--kube-api-burst", KARMADA_CLIENT_BURST),
                flag("--metrics-bind-address", on(self.ports.karmada_scheduler_metrics)),
                flag("--health-probe-bind-address", on(self.ports.karmada_scheduler_health)),
            ],
        }
    }

    /// Namespaces `karmada-system` and `karmada-cluster`, and Karmada's CRDs.
    async fn install_karmada_prerequisites(&self) -> Result<()> {
        let hub = self.karmada_client().await?;
        let namespaces: Api<Namespace> = Api::all(hub);
        for name in [KARMADA_SYSTEM_NAMESPACE, KARMADA_CLUSTER_NAMESPACE] {
            let namespace = Namespace {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    ..ObjectMeta::default()
                },
                ..Namespace::default()
            };
            namespaces
                .patch(name, &apply_params(), &Patch::Apply(&namespace))
                .await?;
        }
        let files = crds::files(&self.binaries.karmada_crds)?;
        if files.is_empty() {
            return Err(Error::BinaryMissing {
                path: self.binaries.karmada_crds.clone(),
                script: crate::paths::build_script(),
            });
        }
        tracing::info!(files = files.len(), "installing Karmada's CRDs into the hub");
        self.install_crd_files(Cluster::Hub, &files).await?;
        Ok(())
    }

    /// The APIService `v1alpha1.cluster.karmada.io` and its `ExternalName` Service.
    async fn register_aggregated_api(&self) -> Result<()> {
        let hub = self.karmada_client().await?;
        let port = i32::from(self.ports.karmada_aggregated_apiserver);
        let service = Service {
            metadata: ObjectMeta {
                name: Some(AGGREGATED_APISERVER_SERVICE.to_owned()),
                namespace: Some(KARMADA_SYSTEM_NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                // The aggregator dials externalName:port itself: no kube-proxy, no Endpoints.
                type_: Some("ExternalName".to_owned()),
                external_name: Some("localhost".to_owned()),
                ports: Some(vec![ServicePort {
                    port,
                    protocol: Some("TCP".to_owned()),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        };
        Api::<Service>::namespaced(hub.clone(), KARMADA_SYSTEM_NAMESPACE)
            .patch(AGGREGATED_APISERVER_SERVICE, &apply_params(), &Patch::Apply(&service))
            .await?;
        let apiservice = APIService {
            metadata: ObjectMeta {
                name: Some(CLUSTER_APISERVICE.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(APIServiceSpec {
                group: Some("cluster.karmada.io".to_owned()),
                version: Some("v1alpha1".to_owned()),
                group_priority_minimum: 2000,
                version_priority: 10,
                // The aggregator reaches `localhost`, a name the serving certificate of a
                // Service would not carry; the recipe skips verification (loopback only).
                insecure_skip_tls_verify: Some(true),
                service: Some(ServiceReference {
                    namespace: Some(KARMADA_SYSTEM_NAMESPACE.to_owned()),
                    name: Some(AGGREGATED_APISERVER_SERVICE.to_owned()),
                    port: Some(port),
                }),
                ..APIServiceSpec::default()
            }),
            ..APIService::default()
        };
        Api::<APIService>::all(hub)
            .patch(CLUSTER_APISERVICE, &apply_params(), &Patch::Apply(&apiservice))
            .await?;
        Ok(())
    }

    /// Waits until the hub reports the APIService Available and serves the `Cluster` list
    /// through it. On failure the error quotes the aggregated apiserver's log.
    pub(crate) async fn wait_aggregated_api(&self, deadline: Duration) -> Result<()> {
        let hub = self.karmada_client().await?;
        let apiservices: Api<APIService> = Api::all(hub.clone());
        let clusters: Api<DynamicObject> = Api::all_with(hub, &cluster_resource());
        let what = format!("APIService {CLUSTER_APISERVICE} to be Available and serve Clusters");
        let waited = wait::until_observed(deadline, &what, || async {
            let apiservice = apiservices.get(CLUSTER_APISERVICE).await?;
            let conditions = apiservice
                .status
                .and_then(|status| status.conditions)
                .unwrap_or_default();
            let available = conditions.iter().find(|condition| condition.type_ == "Available");
            Ok::<_, kube::Error>(match available {
                Some(condition) if condition.status == "True" => match clusters.list(&Default::default()).await {
                    Ok(_) => Check::Ready(()),
                    Err(error) => Check::NotYet(format!("Available, but listing Clusters failed: {error}")),
                },
                Some(condition) => Check::NotYet(format!(
                    "Available={} ({}: {})",
                    condition.status,
                    condition.reason.as_deref().unwrap_or(""),
                    condition.message.as_deref().unwrap_or("")
                )),
                None => Check::NotYet("no Available condition yet".to_owned()),
            })
        })
        .await;
        waited.map_err(|reason| self.daemon_error(Daemon::KarmadaAggregatedApiserver, reason))
    }

    /// Karmada's webhook configurations, rewritten for the local webhook.
    async fn install_webhook_configuration(&self) -> Result<()> {
        let source = &self.binaries.karmada_webhook_configuration;
        let upstream = std::fs::read_to_string(source).map_err(io_context(format!("reading {}", source.display())))?;
        let text = rewrite_webhook_configuration(&upstream, self.ports.karmada_webhook, &self.pki.ca_pem().await?)?;
        let path = self.karmada_dir()?.join("webhook-configuration.yaml");
        write_private(&path, &text)?;
        tracing::info!(
            port = self.ports.karmada_webhook,
            "installing Karmada's webhook configurations"
        );
        self.kubectl_ok(
            Cluster::Hub,
            [
                "apply".into(),
                "--server-side".into(),
                "--force-conflicts".into(),
                format!("--field-manager={FIELD_MANAGER}").into(),
                "-f".into(),
                path.into_os_string(),
            ]
            .iter()
            .map(std::ffi::OsString::as_os_str),
        )
        .await?;
        Ok(())
    }

    /// One Secret and one push-mode `Cluster` per member.
    async fn register_members(&self) -> Result<()> {
        let hub = self.karmada_client().await?;
        let secrets: Api<Secret> = Api::namespaced(hub.clone(), KARMADA_CLUSTER_NAMESPACE);
        let clusters: Api<DynamicObject> = Api::all_with(hub, &cluster_resource());
        let ca = self.pki.ca_pem().await?;
        for member in Cluster::MEMBERS {
            let name = member.name();
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    namespace: Some(KARMADA_CLUSTER_NAMESPACE.to_owned()),
                    ..ObjectMeta::default()
                },
                type_: Some("Opaque".to_owned()),
                data: Some(BTreeMap::from([
                    // Karmada reaches push members with a bearer token only (karmada.md §2.6).
                    ("token".to_owned(), ByteString(self.admin_token.as_bytes().to_vec())),
                    ("caBundle".to_owned(), ByteString(ca.clone())),
                ])),
                ..Secret::default()
            };
            secrets.patch(name, &apply_params(), &Patch::Apply(&secret)).await?;
            let cluster = json!({
                "apiVersion": "cluster.karmada.io/v1alpha1",
                "kind": "Cluster",
                "metadata": { "name": name, "labels": member_labels(member) },
                "spec": {
                    "syncMode": "Push",
                    "apiEndpoint": self.server_url(member),
                    "secretRef": { "namespace": KARMADA_CLUSTER_NAMESPACE, "name": name },
                },
            });
            tracing::info!(
                member = name,
                endpoint = self.server_url(member),
                "registering Karmada member"
            );
            clusters.patch(name, &apply_params(), &Patch::Apply(&cluster)).await?;
        }
        Ok(())
    }

    /// `<state>/karmada`, created if missing: the manifests the harness applied.
    fn karmada_dir(&self) -> Result<PathBuf> {
        let dir = self.dir.join("karmada");
        std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        Ok(dir)
    }
}

async fn wait_for_object<K>(
    api: &Api<K>,
    name: &str,
    deadline: Duration,
    what: &str,
    ready: impl Fn(&K) -> bool,
) -> Result<K>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let ready = &ready;
    wait::until_observed(deadline, what, || async move {
        Ok::<_, kube::Error>(match api.get_opt(name).await? {
            None => Check::NotYet("absent".to_owned()),
            Some(object) if ready(&object) => Check::Ready(object),
            Some(object) => Check::NotYet(format!(
                "present, condition not met (resourceVersion {})",
                object.meta().resource_version.as_deref().unwrap_or("?")
            )),
        })
    })
    .await
}

fn dynamic_api(client: Client, resource: &ApiResource, namespace: Option<&str>) -> Api<DynamicObject> {
    match namespace {
        Some(namespace) => Api::namespaced_with(client, namespace, resource),
        None => Api::all_with(client, resource),
    }
}

fn qualified(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_owned(),
    }
}

fn apply_params() -> PatchParams {
    PatchParams::apply(FIELD_MANAGER).force()
}

fn file_name(path: &std::path::Path) -> std::ffi::OsString {
    path.file_name().map(std::ffi::OsStr::to_os_string).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPSTREAM: &str = "webhooks:\n  - name: work.karmada.io\n    clientConfig:\n      \
        url: https://karmada-webhook.karmada-system.svc:443/mutate-work\n      caBundle: {{caBundle}}\n";

    #[test]
    fn webhook_configuration_points_at_loopback_with_the_ca() -> anyhow::Result<()> {
        let text = rewrite_webhook_configuration(UPSTREAM, 16461, b"PEM")?;
        assert!(text.contains("url: https://127.0.0.1:16461/mutate-work"));
        assert!(text.contains("caBundle: UEVN"));
        assert!(rewrite_webhook_configuration("nothing to rewrite", 1, b"x").is_err());
        let extra = format!("{UPSTREAM}      other: {{{{unknown}}}}\n");
        assert!(rewrite_webhook_configuration(&extra, 1, b"x").is_err());
        Ok(())
    }

    #[test]
    fn members_carry_location_and_gateway_labels() {
        let labels = member_labels(Cluster::CellA);
        assert_eq!(labels.get(LOCATION_LABEL).map(String::as_str), Some("dfw"));
        assert_eq!(labels.get(GATEWAYS_LABEL).map(String::as_str), Some("enabled"));
        assert_eq!(
            member_labels(Cluster::CellB).get(LOCATION_LABEL).map(String::as_str),
            Some("sjc")
        );
        let edge = member_labels(Cluster::Edge1);
        assert!(!edge.contains_key(LOCATION_LABEL) && edge.contains_key(GATEWAYS_LABEL));
    }

    #[test]
    fn readiness_needs_ready_and_no_not_ready_taint() -> anyhow::Result<()> {
        let object = |value: serde_json::Value| -> anyhow::Result<DynamicObject> { Ok(serde_json::from_value(value)?) };
        let base = json!({"apiVersion": "cluster.karmada.io/v1alpha1", "kind": "Cluster", "metadata": {"name": "x"}});
        assert!(member_readiness(&object(base.clone())?).is_err());
        let mut ready = base.clone();
        ready["status"] = json!({"conditions": [{"type": "Ready", "status": "True"}]});
        assert_eq!(member_readiness(&object(ready.clone())?), Ok(()));
        ready["spec"] = json!({"taints": [{"key": "cluster.karmada.io/not-ready", "effect": "NoSchedule"}]});
        assert!(member_readiness(&object(ready)?).is_err());
        let mut not_ready = base;
        not_ready["status"] = json!({"conditions": [{"type": "Ready", "status": "False", "reason": "Down"}]});
        assert!(member_readiness(&object(not_ready)?).is_err());
        Ok(())
    }
}
