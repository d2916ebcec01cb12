//! Sample objects and helpers shared by the demo and the end-to-end scenarios.
//!
//! Builders return the JSON a cell would hold (a galactic EndpointSlice, a Bound
//! NetworkInterface with `compute.datumapis.com/*` labels and `HolderAvailable`, ...);
//! [`apply`] server-side applies one; [`set_status`] writes a status through the subresource;
//! [`routed_namespace`] creates a namespace with the project-routing labels in every cluster.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams},
    discovery::ApiResource,
};
use replicator::rules::{ResourceKind, default_rules};
use serde_json::{Value, json};

use crate::{Cluster, Environment, Error, Result, wait};

/// Field manager of objects the scenarios write in cells.
pub const FIELD_MANAGER: &str = "replicator-e2e";
/// The raw upstream cluster name put on routed namespaces.
pub const UPSTREAM_CLUSTER: &str = "cluster-acme_web";
/// How long a scenario waits for the hub to reflect a cell change.
pub const CONVERGE: Duration = Duration::from_secs(20);

/// The API resource of a default rule's kind, by rule name (`networkinterfaces`, ...).
///
/// # Errors
/// [`Error::Scenario`] for an unknown rule name.
pub fn resource(rule: &str) -> Result<ApiResource> {
    default_rules()
        .into_iter()
        .find(|r| r.name == rule)
        .map(|r| r.resource.api_resource())
        .ok_or_else(|| Error::Scenario(format!("no default rule named {rule}")))
}

/// The resource kind of a default rule, by rule name.
///
/// # Errors
/// As [`resource`].
pub fn kind(rule: &str) -> Result<ResourceKind> {
    default_rules()
        .into_iter()
        .find(|r| r.name == rule)
        .map(|r| r.resource)
        .ok_or_else(|| Error::Scenario(format!("no default rule named {rule}")))
}

/// Label marking the sources of one scenario, its namespace as value (see [`scenario_rules`]).
pub const SCENARIO_LABEL: &str = "e2e.replicator.datumapis.com/scenario";

/// Writes a rules file, `<env>/scratch/<namespace>-rules.yaml`, under which the only sources
/// are objects of the default rules named in `rules` that carry [`SCENARIO_LABEL`]`=<namespace>`
/// (each rule is the default, its selector narrowed by that label), and every other default rule
/// is disabled. Returns its path, for `--rules`.
///
/// Scenarios run side by side and all route their namespaces in cell-a, so a replicator of any
/// location mirrors every scenario's sources there. One that counts what its location wrote or
/// swept (an exact `replicator_sweep_deleted_total`, the copies held) runs under these rules and
/// labels its sources ([`scenario_labelled`]); the others need not.
///
/// # Errors
/// [`Error::Scenario`] for a name that is no default rule; I/O errors writing the file.
pub fn scenario_rules(env: &Environment, namespace: &str, rules: &[&str]) -> Result<std::path::PathBuf> {
    let defaults = default_rules();
    if let Some(unknown) = rules.iter().find(|n| !defaults.iter().any(|r| r.name == **n)) {
        return Err(Error::Scenario(format!("no default rule named {unknown}")));
    }
    let mut entries = Vec::new();
    for rule in defaults {
        if !rules.contains(&rule.name.as_str()) {
            entries.push(json!({"name": rule.name, "enabled": false}));
            continue;
        }
        let mut entry = serde_json::to_value(&rule).map_err(|e| Error::Scenario(format!("rule {}: {e}", rule.name)))?;
        entry["sourceSelector"]["matchLabels"][SCENARIO_LABEL] = json!(namespace);
        entries.push(entry);
    }
    let scratch = env.dir().join("scratch");
    std::fs::create_dir_all(&scratch).map_err(crate::error::io_context("creating the scratch directory"))?;
    let path = scratch.join(format!("{namespace}-rules.yaml"));
    let yaml = serde_saphyr::to_string(&json!({ "rules": entries }))
        .map_err(|e| Error::Scenario(format!("rules file for {namespace}: {e}")))?;
    std::fs::write(&path, &yaml).map_err(crate::error::io_context(format!("writing {}", path.display())))?;
    Ok(path)
}

/// `object` (a fixture of namespace `metadata.namespace`) labelled as a source of its
/// scenario's [`scenario_rules`].
pub fn scenario_labelled(mut object: Value) -> Value {
    let namespace = object["metadata"]["namespace"].clone();
    object["metadata"]["labels"][SCENARIO_LABEL] = namespace;
    object
}

/// A short random lowercase suffix, so scenarios never collide with earlier runs.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let mixed = nanos ^ std::process::id().rotate_left(16);
    format!("{prefix}-{:06x}", mixed & 0xff_ffff)
}

/// Creates namespace `name` in `clusters`, with the project-routing labels when `routed`.
///
/// # Errors
/// Any API error other than AlreadyExists.
pub async fn namespace(env: &Environment, clusters: &[Cluster], name: &str, routed: bool) -> Result<()> {
    let mut labels = BTreeMap::new();
    if routed {
        labels.insert(
            replicator::routing::UPSTREAM_CLUSTER_LABEL.to_owned(),
            UPSTREAM_CLUSTER.to_owned(),
        );
        labels.insert(
            replicator::routing::UPSTREAM_NAMESPACE_LABEL.to_owned(),
            "default".to_owned(),
        );
    }
    for cluster in clusters {
        let api = Api::<Namespace>::all(env.client(*cluster).await?);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(labels.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Creates a routed namespace `name` on the hub and waits until Karmada has delivered it, with
/// its labels, to every member cluster (as namespaces reach cells in production).
///
/// # Errors
/// As [`namespace`], or [`Error::Timeout`] when a member does not get it.
pub async fn routed_namespace(env: &Environment, name: &str) -> Result<()> {
    namespace(env, &[Cluster::Hub], name, true).await?;
    for member in Cluster::MEMBERS {
        let api = Api::<Namespace>::all(env.client(member).await?);
        let what = format!("namespace {name} delivered to {}", member.name());
        wait::until(CONVERGE, &what, || {
            let api = api.clone();
            async move {
                Ok::<_, kube::Error>(api.get_opt(name).await?.filter(|ns| {
                    ns.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.contains_key(replicator::routing::UPSTREAM_CLUSTER_LABEL))
                }))
            }
        })
        .await?;
    }
    Ok(())
}

/// Server-side applies `object` (which names its apiVersion, kind, name and namespace).
///
/// # Errors
/// The API error.
pub async fn apply(client: &Client, resource: &ApiResource, object: &Value) -> Result<DynamicObject> {
    let (namespace, name) = identity(object)?;
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &namespace, resource);
    Ok(api
        .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(object))
        .await?)
}

/// Writes `status` on `namespace/name` through the status subresource (merge patch).
///
/// # Errors
/// The API error.
pub async fn set_status(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    name: &str,
    status: Value,
) -> Result<DynamicObject> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource);
    Ok(api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await?)
}

/// Deletes `namespace/name`; NotFound is success.
///
/// # Errors
/// Any other API error.
pub async fn delete(client: &Client, resource: &ApiResource, namespace: &str, name: &str) -> Result<()> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource);
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Reads `namespace/name`, `None` when absent.
///
/// # Errors
/// Any API error other than NotFound.
pub async fn get(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    name: &str,
) -> Result<Option<DynamicObject>> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource);
    Ok(api.get_opt(name).await?)
}

/// Waits until `namespace/name` exists and satisfies `check`, returning it.
///
/// # Errors
/// [`Error::Timeout`] naming the object and what was last seen.
pub async fn wait_for(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    name: &str,
    deadline: Duration,
    what: &str,
    check: impl Fn(&DynamicObject) -> bool,
) -> Result<DynamicObject> {
    let label = format!("{what} ({} {namespace}/{name})", resource.kind);
    wait::until_observed(deadline, &label, || {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource);
        let check = &check;
        async move {
            Ok::<_, kube::Error>(match api.get_opt(name).await? {
                Some(o) if check(&o) => wait::Check::Ready(o),
                Some(o) => wait::Check::NotYet(format!("present but not as expected: {}", summary(&o))),
                None => wait::Check::NotYet("absent".into()),
            })
        }
    })
    .await
}

/// Waits until `namespace/name` is absent.
///
/// # Errors
/// [`Error::Timeout`].
pub async fn wait_gone(
    client: &Client,
    resource: &ApiResource,
    namespace: &str,
    name: &str,
    deadline: Duration,
) -> Result<()> {
    let label = format!("{} {namespace}/{name} to be gone", resource.kind);
    wait::until_observed(deadline, &label, || {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource);
        async move {
            Ok::<_, kube::Error>(match api.get_opt(name).await? {
                Some(o) => wait::Check::NotYet(format!("still present: {}", summary(&o))),
                None => wait::Check::Ready(()),
            })
        }
    })
    .await
}

fn summary(o: &DynamicObject) -> String {
    let mut v = serde_json::to_value(o).unwrap_or(Value::Null);
    if let Some(meta) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    let mut s = v.to_string();
    s.truncate(600);
    s
}

fn identity(object: &Value) -> Result<(String, String)> {
    let meta = &object["metadata"];
    match (meta["namespace"].as_str(), meta["name"].as_str()) {
        (Some(ns), Some(name)) => Ok((ns.to_owned(), name.to_owned())),
        _ => Err(Error::Scenario(format!(
            "object without metadata.namespace/name: {object}"
        ))),
    }
}

/// A Network.
pub fn network(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "networking.datumapis.com/v1alpha",
        "kind": "Network",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"ipam": {"mode": "Auto", "ipv6Range": "fd20::/48"}, "ipFamilies": ["IPv6"], "mtu": 1460}
    })
}

/// A NetworkContext of `network` in `location`, labelled with both.
pub fn network_context(namespace: &str, name: &str, network: &str, location: &str) -> Value {
    json!({
        "apiVersion": "networking.datumapis.com/v1alpha",
        "kind": "NetworkContext",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            "networking.datumapis.com/location": location,
            "networking.datumapis.com/network": network
        }},
        "spec": {"network": {"name": network}, "location": {"name": location}, "ipFamilies": ["IPv6"], "mtu": 1460}
    })
}

/// A Subnet of `context` in `location`.
pub fn subnet(namespace: &str, name: &str, network: &str, context: &str, location: &str) -> Value {
    json!({
        "apiVersion": "networking.datumapis.com/v1alpha",
        "kind": "Subnet",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            "networking.datumapis.com/location": location,
            "networking.datumapis.com/network": network
        }},
        "spec": {"subnetClass": "private", "networkContext": {"name": context}, "location": {"name": location},
                 "ipFamily": "IPv6", "startAddress": "fd20:0:0:1::", "prefixLength": 64}
    })
}

/// A NetworkInterface on `network`, held by claim `claim`, with compute labels of `workload`.
pub fn network_interface(
    namespace: &str,
    name: &str,
    network: &str,
    claim: &str,
    workload: &str,
    location: &str,
) -> Value {
    json!({
        "apiVersion": "networking.datumapis.com/v1alpha",
        "kind": "NetworkInterface",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            "compute.datumapis.com/workload": workload,
            "compute.datumapis.com/instance-index": "0",
            "networking.datumapis.com/location": location,
            "app.kubernetes.io/name": "not-allowed"
        }},
        "spec": {
            "network": {"name": network},
            "claimRef": {"name": claim},
            "interfaceName": "eth0",
            "attachmentMode": "Netns",
            "mtu": 1460,
            "addresses": [{"family": "IPv6", "address": "fd20:0:0:1::10/64", "gateway": "fd20:0:0:1::1", "primary": true}],
            "externalAddresses": [{"family": "IPv4", "address": "203.0.113.10"}]
        }
    })
}

/// The status of a Bound interface whose holder reports `holder_available`.
pub fn bound_status(holder_available: bool) -> Value {
    let (status, reason) = if holder_available {
        ("True", "HolderAvailable")
    } else {
        ("False", "HolderUnavailable")
    };
    json!({
        "phase": "Bound",
        "vpc": "vpc-1",
        "networkContextRef": {"name": "ctx"},
        "conditions": [
            {"type": "HolderAvailable", "status": status, "reason": reason, "message": "reported by compute",
             "lastTransitionTime": "2026-11-29T00:00:00Z", "observedGeneration": 1},
            {"type": "Programmed", "status": "Unknown", "reason": "Pending", "message": "",
             "lastTransitionTime": "2026-11-29T00:00:00Z"}
        ]
    })
}

/// The SRv6 SID annotation galactic puts on per-pod slices.
pub const SRV6_SID_ANNOTATION: &str = "galactic.datum.net/srv6-sid";

/// A galactic per-pod EndpointSlice (IPv6, label and annotation `galactic.datum.net/tenant-id`),
/// with `endpoints` given verbatim and no ports.
pub fn galactic_slice(namespace: &str, name: &str, endpoints: Value, sid: Option<&str>) -> Value {
    let mut annotations = json!({"galactic.datum.net/tenant-id": "vpc7Xq-att9Zk"});
    if let Some(sid) = sid {
        annotations[SRV6_SID_ANNOTATION] = json!(sid);
    }
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace,
            "labels": {"galactic.datum.net/tenant-id": "vpc7Xq-att9Zk"},
            "annotations": annotations},
        "addressType": "IPv6",
        "endpoints": endpoints
    })
}

/// One endpoint as galactic writes it: the pod's IPv6 address, Ready, a Pod targetRef.
pub fn pod_endpoint(address: &str, pod: &str) -> Value {
    json!({"addresses": [address], "conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"}})
}

/// The API resource of NetworkService.
pub fn network_service_resource() -> ApiResource {
    kube::discovery::ApiResource::erase::<replicator::api::NetworkService>(&())
}

/// A NetworkService selecting interfaces labelled `compute.datumapis.com/workload: <workload>`,
/// with one TCP port `http` on 8080.
pub fn network_service(namespace: &str, name: &str, workload: &str) -> Value {
    json!({
        "apiVersion": "networking.datumapis.com/v1alpha",
        "kind": "NetworkService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "networkInterfaces": {"selector": {"matchLabels": {"compute.datumapis.com/workload": workload}}},
            "ports": [{"name": "http", "port": 8080}]
        }
    })
}

/// The five kinds of the sample input (rule names).
pub const SAMPLE_RULES: [&str; 5] = [
    "networks",
    "networkcontexts",
    "subnets",
    "networkinterfaces",
    "endpointslices",
];

/// The sample input's 240-character slice name: its copy name must be shortened.
pub fn sample_long_name() -> String {
    let mut name = "galactic-pod-with-a-very-long-generated-name-".repeat(6);
    name.truncate(236);
    format!("{name}-x9z")
}

/// Writes the sample input of the demo (and the README scenario) for `location` into namespace
/// `ns` through `client`: a Network, a NetworkContext, a Subnet, two Bound NetworkInterfaces of
/// workload `web` (addresses in `fd20:0:<site>:1::/64`) whose holders are available, and three
/// galactic slices (SRv6 SID `fc00:0:<site>:e000::`; one with a long name, one empty). Returns
/// the source names written, by rule name.
///
/// # Errors
/// Any failed apply or status write.
pub async fn sample_input(
    client: &Client,
    ns: &str,
    location: &str,
    site: u8,
) -> Result<BTreeMap<&'static str, Vec<String>>> {
    let mut written: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
    apply(client, &resource("networks")?, &network(ns, "default")).await?;
    written.entry("networks").or_default().push("default".into());
    let ctx = format!("default-{location}");
    apply(
        client,
        &resource("networkcontexts")?,
        &network_context(ns, &ctx, "default", location),
    )
    .await?;
    written.entry("networkcontexts").or_default().push(ctx.clone());
    let subnet_name = format!("{ctx}-1");
    apply(
        client,
        &resource("subnets")?,
        &subnet(ns, &subnet_name, "default", &ctx, location),
    )
    .await?;
    written.entry("subnets").or_default().push(subnet_name);
    let ni = resource("networkinterfaces")?;
    for i in 0..2 {
        let name = format!("web-{i}-eth0");
        let mut interface = network_interface(ns, &name, "default", &format!("web-{i}"), "web", location);
        interface["spec"]["addresses"] =
            json!([{"family": "IPv6", "address": format!("fd20:0:{site}:1::{}/64", 10 + i), "primary": true}]);
        apply(client, &ni, &interface).await?;
        set_status(client, &ni, ns, &name, bound_status(true)).await?;
        written.entry("networkinterfaces").or_default().push(name);
    }
    let es = resource("endpointslices")?;
    let sid = format!("fc00:0:{site}:e000::");
    let pod = format!("web-0-{location}");
    let long = sample_long_name();
    let slices = [
        (
            pod.clone(),
            json!([pod_endpoint("fd20:0:0:1::10", &pod)]),
            Some(sid.as_str()),
        ),
        (
            long,
            json!([pod_endpoint("fd20:0:0:1::11", "long")]),
            Some(sid.as_str()),
        ),
        ("empty-pod".to_owned(), json!([]), None),
    ];
    for (name, endpoints, sid) in slices {
        apply(client, &es, &galactic_slice(ns, &name, endpoints, sid)).await?;
        written.entry("endpointslices").or_default().push(name);
    }
    Ok(written)
}

/// The path of a fixture file of the e2e crate, `e2e/testdata/<name>`.
pub fn testdata(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(name)
}

/// How long a CRD or a fresh binding may take to take effect.
const TAKES_EFFECT: Duration = Duration::from_secs(60);

/// Server-side applies the CRDs of `file` to each of `clusters` and waits until they are
/// Established. Idempotent; the CRDs are left installed (cluster-scoped infrastructure, like the
/// project's own CRDs), so concurrent scenarios may call it at once.
///
/// # Errors
/// A failed apply, or a CRD not Established within a minute.
pub async fn ensure_crds(env: &Environment, clusters: &[Cluster], file: &std::path::Path) -> Result<()> {
    for cluster in clusters {
        env.kubectl_ok(
            *cluster,
            [
                "apply".as_ref(),
                "--server-side".as_ref(),
                "--force-conflicts".as_ref(),
                std::ffi::OsStr::new(&format!("--field-manager={FIELD_MANAGER}")),
                "-f".as_ref(),
                file.as_os_str(),
            ],
        )
        .await?;
        env.kubectl_ok(
            *cluster,
            [
                "wait".as_ref(),
                "--for=condition=Established".as_ref(),
                std::ffi::OsStr::new(&format!("--timeout={}s", TAKES_EFFECT.as_secs())),
                "-f".as_ref(),
                file.as_os_str(),
            ],
        )
        .await?;
    }
    Ok(())
}

/// The object kinds an identity render keeps: what the replicator's own identity is made of.
const IDENTITY_KINDS: [&str; 5] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
];

/// What [`composed_identity`] renders: the shipped `config/rbac/cell` and `config/rbac/hub` (with
/// `config/rbac/hub/location` binding the location's account), each with the kustomize
/// components an operator adds beside them (paths under `config/`, for example
/// `components/vpcattachments/cell`), and an optional edit of the rendered cell objects (a
/// scenario that needs a narrower role than the shipped one says exactly what it takes away).
pub struct IdentitySpec<'a> {
    /// A short DNS label naming the identity: every rendered cell name, and the hub's role and
    /// binding names, get `-<name>-e2e`.
    pub name: &'a str,
    /// The location the process runs as (`--location`): the hub account is
    /// `replicator-<location>`, the name the hub's admission policies read the location from.
    pub location: &'a str,
    /// The cell the identity is created in.
    pub cell: Cluster,
    /// Components added to `config/rbac/cell`.
    pub cell_components: &'a [&'a str],
    /// Components added to `config/rbac/hub`.
    pub hub_components: &'a [&'a str],
    /// Applied to every rendered cell object (ServiceAccount, ClusterRole, ...) before it is applied.
    pub edit_cell: Option<&'a (dyn Fn(&mut Value) + Sync)>,
}

/// An identity of `replicator run` made by [`composed_identity`]; [`ComposedIdentity::remove`]
/// deletes what was applied (a scenario calls it from its teardown).
#[derive(Debug, Clone)]
pub struct ComposedIdentity {
    /// Kubeconfig of the cell service account.
    pub cell_kubeconfig: std::path::PathBuf,
    /// Kubeconfig of the hub service account.
    pub hub_kubeconfig: std::path::PathBuf,
    /// The hub namespace of the hub service account (`replicator-e2e-<name>`, the identity's own).
    pub hub_namespace: String,
    /// The files applied, with their cluster.
    pub applied: Vec<(Cluster, std::path::PathBuf)>,
    kubectl: std::path::PathBuf,
    admin: BTreeMap<Cluster, std::path::PathBuf>,
}

impl ComposedIdentity {
    /// Deletes every object the identity applied (`kubectl delete --ignore-not-found`), best
    /// effort, blocking: callable from a `Drop`. The location's hub identity of
    /// [`crate::rbac::Identities::hub_kubeconfig_for`] (same account name, other namespace) is
    /// not touched.
    pub fn remove(&self) {
        for (cluster, file) in &self.applied {
            let Some(admin) = self.admin.get(cluster) else {
                continue;
            };
            let status = std::process::Command::new(&self.kubectl)
                .arg("--kubeconfig")
                .arg(admin)
                .args(["delete", "--ignore-not-found", "--wait=false", "-f"])
                .arg(file)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
            if !status.is_ok_and(|s| s.success()) {
                eprintln!("removing the identity objects of {} failed", file.display());
            }
        }
    }
}

/// Renders the replicator's identity the way an operator composes it and applies its RBAC
/// objects, then writes token kubeconfigs of its two service accounts:
///
/// - in `spec.cell`: `config/rbac/cell` plus components, through a wrapper that moves it into
///   namespace [`crate::rbac::NAMESPACE`] and suffixes every name with `-<name>-e2e`
///   (account `replicator-<name>-e2e`);
/// - on the hub: `config/rbac/hub` plus components with `config/rbac/hub/location` under
///   `nameSuffix: -<location>` (as `config/overlays/<location>/hub` does), the names of roles
///   and bindings suffixed with `-<name>-e2e`; kept are the account `replicator-<location>` and
///   what binds it. The account lives in a hub namespace of the identity's own,
///   `replicator-e2e-<name>` (the admission policies match the account name in any
///   namespace), so that it never shares a token or a grant with the location's identity of
///   [`crate::rbac::Identities::hub_kubeconfig_for`]. The Lease Role and its binding land in
///   [`crate::rbac::NAMESPACE`], the namespace [`crate::ReplicatorProcess::spawn`] passes as
///   `--lease-namespace`.
///
/// Waits until the last rule of every rendered role is allowed.
///
/// # Errors
/// A failed render, apply or token request, or a binding that never takes effect.
pub async fn composed_identity(env: &Environment, spec: &IdentitySpec<'_>) -> Result<ComposedIdentity> {
    crate::rbac::validate_location(spec.location)?;
    let suffix = format!("{}-{}", spec.name, crate::rbac::NAME_SUFFIX);
    let work = env.dir().join("scratch").join(format!("identity-{}", spec.name));
    let hub_namespace = format!("{}-{}", crate::rbac::NAMESPACE, spec.name);
    let cell_account = format!("replicator-{suffix}");
    let hub_account = crate::rbac::hub_service_account(spec.location);
    let mut applied = Vec::new();
    let mut kubeconfigs = Vec::new();
    for (cluster, target, components) in [
        (spec.cell, "rbac/cell", spec.cell_components),
        (Cluster::Hub, "rbac/hub", spec.hub_components),
    ] {
        let dir = work.join(target.replace('/', "-"));
        std::fs::create_dir_all(&dir).map_err(|e| Error::Scenario(format!("creating {}: {e}", dir.display())))?;
        let mut k = format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\n",
            crate::rbac::config_relative(&dir, target).display()
        );
        if cluster == Cluster::Hub {
            // The location's binding of the shipped roles, named as its hub overlay names it.
            let location = dir.join("location");
            write_file(
                &location.join("kustomization.yaml"),
                &format!(
                    "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {}\n\
                     nameSuffix: \"-{}\"\n",
                    crate::rbac::config_relative(&location, "rbac/hub/location").display(),
                    spec.location
                ),
            )?;
            k.push_str("- location\n");
        }
        if !components.is_empty() {
            k.push_str("components:\n");
        }
        for component in components {
            k.push_str(&format!(
                "- {}\n",
                crate::rbac::config_relative(&dir, component).display()
            ));
        }
        k.push_str(&format!("namespace: \"{}\"\n", crate::rbac::NAMESPACE));
        if cluster == Cluster::Hub {
            // Roles and bindings only: the account keeps its name (`replicator-<location>`).
            let transformer = crate::rbac::suffix_transformer(
                "identity",
                &suffix,
                &["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"],
            );
            k.push_str("transformers:\n- |-\n");
            for line in transformer.lines() {
                k.push_str(&format!("  {line}\n"));
            }
        } else {
            k.push_str(&format!("nameSuffix: \"-{suffix}\"\n"));
        }
        write_file(&dir.join("kustomization.yaml"), &k)?;
        let rendered = env
            .kubectl_ok(
                Cluster::Hub,
                [std::ffi::OsString::from("kustomize"), dir.clone().into_os_string()],
            )
            .await?;
        let all: Vec<Value> = serde_saphyr::from_multiple::<Value>(&rendered)
            .map_err(|e| Error::Scenario(format!("parsing the render of {}: {e}", dir.display())))?;
        let (account, namespace, mut items) = if cluster == Cluster::Hub {
            let items = hub_identity_objects(all, &hub_account, &hub_namespace);
            (hub_account.as_str(), hub_namespace.as_str(), items)
        } else {
            let mut items: Vec<Value> = all
                .into_iter()
                .filter(|o| o["kind"].as_str().is_some_and(|k| IDENTITY_KINDS.contains(&k)))
                .collect();
            if let Some(edit) = spec.edit_cell {
                items.iter_mut().for_each(edit);
            }
            (cell_account.as_str(), crate::rbac::NAMESPACE, items)
        };
        if !items
            .iter()
            .any(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == account)
        {
            return Err(Error::Scenario(format!(
                "config/{target} renders no ServiceAccount {account}"
            )));
        }
        env.ensure_namespace(cluster, namespace).await?;
        if namespace != crate::rbac::NAMESPACE {
            // The identity's own namespace goes with it.
            env.ensure_namespace(cluster, crate::rbac::NAMESPACE).await?;
            items.insert(
                0,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": {
                    crate::rbac::KARMADA_SKIP_PROPAGATION_LABEL: "true"
                }}}),
            );
        }
        let list = dir.join("identity.json");
        write_file(
            &list,
            &json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string(),
        )?;
        applied.push((cluster, list.clone()));
        env.kubectl_ok(
            cluster,
            [
                "apply".as_ref(),
                "--server-side".as_ref(),
                "--force-conflicts".as_ref(),
                std::ffi::OsStr::new(&format!("--field-manager={FIELD_MANAGER}")),
                "-f".as_ref(),
                list.as_os_str(),
            ],
        )
        .await?;
        let token = env.service_account_token(cluster, namespace, account, "2h").await?;
        let kubeconfig = work.join(format!("{}.kubeconfig", cluster.name()));
        crate::rbac::write_token_kubeconfig(env, cluster, &env.server_url(cluster), &token, &kubeconfig).await?;
        wait_roles_in_force(&kubeconfig, &items).await?;
        kubeconfigs.push(kubeconfig);
    }
    let hub_kubeconfig = kubeconfigs.pop().unwrap_or_default();
    let cell_kubeconfig = kubeconfigs.pop().unwrap_or_default();
    Ok(ComposedIdentity {
        cell_kubeconfig,
        hub_kubeconfig,
        hub_namespace,
        kubectl: env.binaries().kubectl.clone(),
        admin: [spec.cell, Cluster::Hub]
            .into_iter()
            .map(|c| (c, env.kubeconfig_path(c)))
            .collect(),
        applied,
    })
}

/// Of a hub render, the account `account` (moved to `namespace`), the bindings naming it as a
/// subject (their subjects moved with it) and the roles they bind: membership's objects, the
/// admission policies and the Namespace stay out.
fn hub_identity_objects(all: Vec<Value>, account: &str, namespace: &str) -> Vec<Value> {
    let names_account = |o: &Value| {
        o["subjects"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["kind"] == "ServiceAccount" && s["name"] == account))
    };
    let bound: Vec<(String, String)> = all
        .iter()
        .filter(|o| matches!(o["kind"].as_str(), Some("ClusterRoleBinding" | "RoleBinding")) && names_account(o))
        .map(|o| {
            (
                o["roleRef"]["kind"].as_str().unwrap_or_default().to_owned(),
                o["roleRef"]["name"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let mut items: Vec<Value> = all
        .into_iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            match kind {
                "ServiceAccount" => name == account,
                "ClusterRoleBinding" | "RoleBinding" => names_account(o),
                "ClusterRole" | "Role" => bound.iter().any(|(k, n)| k == kind && n == name),
                _ => false,
            }
        })
        .collect();
    for o in &mut items {
        if o["kind"] == "ServiceAccount" {
            o["metadata"]["namespace"] = json!(namespace);
        }
        // (`get_mut`: indexing a missing key mutably would add it.)
        if let Some(subjects) = o.get_mut("subjects").and_then(Value::as_array_mut) {
            for s in subjects.iter_mut().filter(|s| s["name"] == account) {
                s["namespace"] = json!(namespace);
            }
        }
    }
    items
}

fn write_file(path: &std::path::Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::Scenario(format!("creating {}: {e}", parent.display())))?;
    }
    std::fs::write(path, text).map_err(|e| Error::Scenario(format!("writing {}: {e}", path.display())))
}

/// Waits until the identity of `kubeconfig` is allowed the last rule of every Role and
/// ClusterRole in `items` (a fresh binding reaches the authorizer through an informer).
async fn wait_roles_in_force(kubeconfig: &std::path::Path, items: &[Value]) -> Result<()> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let api = Api::<SelfSubjectAccessReview>::all(crate::kubeconfig::client(kubeconfig).await?);
    for role in items
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
    {
        let Some(rule) = role["rules"].as_array().and_then(|r| r.last()) else {
            continue;
        };
        let attributes = ResourceAttributes {
            group: rule["apiGroups"][0].as_str().map(str::to_owned),
            resource: rule["resources"][0].as_str().map(str::to_owned),
            verb: rule["verbs"][0].as_str().map(str::to_owned),
            namespace: role["metadata"]["namespace"].as_str().map(str::to_owned),
            ..ResourceAttributes::default()
        };
        let what = format!("{attributes:?} to be allowed ({})", role["metadata"]["name"]);
        wait::until(TAKES_EFFECT, &what, || {
            let (api, attributes) = (api.clone(), attributes.clone());
            async move {
                let review = SelfSubjectAccessReview {
                    spec: SelfSubjectAccessReviewSpec {
                        resource_attributes: Some(attributes),
                        ..SelfSubjectAccessReviewSpec::default()
                    },
                    ..SelfSubjectAccessReview::default()
                };
                let allowed = api
                    .create(&PostParams::default(), &review)
                    .await?
                    .status
                    .is_some_and(|s| s.allowed);
                Ok::<_, kube::Error>(allowed.then_some(()))
            }
        })
        .await?;
    }
    Ok(())
}

/// Creates namespace `name` in each of `clusters` directly (kept from Karmada's namespace
/// propagation), routed to project `upstream_cluster`/`upstream_namespace`: the values of
/// `meta.datumapis.com/upstream-cluster-name` and `.../upstream-namespace`.
///
/// # Errors
/// Any API error other than AlreadyExists.
pub async fn namespace_routed_to(
    env: &Environment,
    clusters: &[Cluster],
    name: &str,
    upstream_cluster: &str,
    upstream_namespace: &str,
) -> Result<()> {
    for cluster in clusters {
        let api = Api::<Namespace>::all(env.client(*cluster).await?);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(BTreeMap::from([
                    (
                        replicator::routing::UPSTREAM_CLUSTER_LABEL.to_owned(),
                        upstream_cluster.to_owned(),
                    ),
                    (
                        replicator::routing::UPSTREAM_NAMESPACE_LABEL.to_owned(),
                        upstream_namespace.to_owned(),
                    ),
                    (
                        crate::rbac::KARMADA_SKIP_PROPAGATION_LABEL.to_owned(),
                        "true".to_owned(),
                    ),
                ])),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The API resource of galactic's VPCAttachment (`cloud.datumapis.com/v1alpha1`), the kind
/// `config/components/vpcattachments` adds.
pub fn vpc_attachment_resource() -> ApiResource {
    ApiResource {
        group: "cloud.datumapis.com".into(),
        version: "v1alpha1".into(),
        api_version: "cloud.datumapis.com/v1alpha1".into(),
        kind: "VPCAttachment".into(),
        plural: "vpcattachments".into(),
    }
}

/// A VPCAttachment as galactic writes it: `labels`, on VPC `vpc`, interface `eth1` with
/// `addresses`, realizing NetworkInterface `interface` (`spec.interfaceRef`).
pub fn vpc_attachment(
    namespace: &str,
    name: &str,
    labels: Value,
    vpc: &str,
    addresses: &[&str],
    interface: &str,
) -> Value {
    json!({
        "apiVersion": "cloud.datumapis.com/v1alpha1",
        "kind": "VPCAttachment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "vpc": {"name": vpc},
            "interface": {"name": "eth1", "mode": "Netns", "addresses": addresses},
            "interfaceRef": {"name": interface}
        }
    })
}

/// Removes what a scenario made when dropped, pass or fail: the identities it composed, the
/// cluster-scoped hub objects it applied (Karmada policies), its namespaces (the namespace
/// controllers of the hub and the cells delete the sources, copies and services in them) and the hub Leases its processes elected on (in [`crate::rbac::NAMESPACE`]).
/// The locations' hub identities its processes ran as ([`crate::rbac::Identities::hub_kubeconfig_for`])
/// stay: they are environment fixtures, which another scenario may be running as.
/// Declare it before the processes: locals drop in reverse order, so they are killed first.
pub struct Teardown {
    kubectl: std::path::PathBuf,
    kubeconfigs: BTreeMap<Cluster, std::path::PathBuf>,
    namespaces: Vec<(Cluster, String)>,
    leases: Vec<String>,
    hub_objects: Vec<(String, String)>,
    hub_manifests: Vec<std::path::PathBuf>,
    identities: Vec<ComposedIdentity>,
}

impl Teardown {
    /// Nothing to remove yet.
    pub fn new(env: &Environment) -> Teardown {
        Teardown {
            kubectl: env.binaries().kubectl.clone(),
            kubeconfigs: Cluster::ALL.into_iter().map(|c| (c, env.kubeconfig_path(c))).collect(),
            namespaces: Vec::new(),
            leases: Vec::new(),
            hub_objects: Vec::new(),
            hub_manifests: Vec::new(),
            identities: Vec::new(),
        }
    }

    /// The teardown of a scenario in namespace `namespace` of every cluster (as
    /// [`routed_namespace`] makes it: on the hub, delivered by Karmada to every member) whose
    /// `replicator run` processes ran as `locations`: the namespace everywhere and each location's
    /// hub Lease.
    pub fn scenario(env: &Environment, namespace: &str, locations: &[&str]) -> Teardown {
        let mut teardown = Teardown::new(env);
        teardown.namespace(&Cluster::ALL, namespace);
        for location in locations {
            teardown.lease(&format!("replicator-{location}"));
        }
        teardown
    }

    /// Removes namespace `name` from each of `clusters`.
    pub fn namespace(&mut self, clusters: &[Cluster], name: &str) {
        self.namespaces.extend(clusters.iter().map(|c| (*c, name.to_owned())));
    }

    /// Removes hub Lease `name` (of `replicator run`: `replicator-<location>`).
    pub fn lease(&mut self, name: &str) {
        self.leases.push(name.to_owned());
    }

    /// Removes cluster-scoped hub object `name` of `resource` (as kubectl names it, e.g.
    /// `clusterpropagationpolicies.policy.karmada.io`).
    pub fn hub_object(&mut self, resource: &str, name: &str) {
        self.hub_objects.push((resource.to_owned(), name.to_owned()));
    }

    /// Removes the hub objects manifest `path` holds (as `kubectl delete -f`, waiting for
    /// their finalizers).
    pub fn hub_manifest(&mut self, path: &std::path::Path) {
        self.hub_manifests.push(path.to_owned());
    }

    /// Removes what `identity` applied.
    pub fn identity(&mut self, identity: &ComposedIdentity) {
        self.identities.push(identity.clone());
    }

    fn kubectl(&self, cluster: Cluster, args: &[&str]) {
        let Some(kubeconfig) = self.kubeconfigs.get(&cluster) else {
            return;
        };
        let status = std::process::Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            eprintln!("teardown: kubectl {} in {cluster} failed", args.join(" "));
        }
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        for identity in &self.identities {
            identity.remove();
        }
        for path in &self.hub_manifests {
            let path = path.display().to_string();
            self.kubectl(Cluster::Hub, &["delete", "-f", &path, "--ignore-not-found"]);
        }
        for (resource, name) in &self.hub_objects {
            self.kubectl(Cluster::Hub, &["delete", resource, name, "--ignore-not-found"]);
        }
        for (cluster, ns) in &self.namespaces {
            self.kubectl(
                *cluster,
                &["delete", "namespace", ns, "--ignore-not-found", "--wait=false"],
            );
        }
        for lease in &self.leases {
            self.kubectl(
                Cluster::Hub,
                &[
                    "-n",
                    crate::rbac::NAMESPACE,
                    "delete",
                    "lease",
                    lease,
                    "--ignore-not-found",
                ],
            );
        }
    }
}
