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
