//! CRD types of `networking.datumapis.com/v1alpha` that the replicator mirrors.
//!
//! The mirror path itself is schema-agnostic (it works on dynamic objects, see [`crate::copy`]);
//! these typed structs serve CRD generation (`replicator crds`), the code that reads fields, and
//! tests. Shapes follow the Go system we replace (the NetworkService types of the Go system).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of every kind in this module.
pub const GROUP: &str = "networking.datumapis.com";
/// The API version of every kind in this module.
pub const VERSION: &str = "v1alpha";

/// A reference to an object by name in the same namespace.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct LocalObjectReference {
    /// Name of the referenced object.
    pub name: String,
}

/// A reference to a location (a `ServingLocation` or location object), by name and namespace.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct LocationReference {
    /// Name of the location.
    pub name: String,
    /// Namespace of the location object, when it is namespaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// An IP family: `IPv4` or `IPv6`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    /// IPv4.
    IPv4,
    /// IPv6, the default family of a Network.
    #[default]
    IPv6,
}

/// How a Network's addresses are managed.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkIpam {
    /// IPAM mode, for example `Auto` or `Policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// IPv4 range (CIDR) to allocate from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4_range: Option<String>,
    /// IPv6 range (CIDR) to allocate from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6_range: Option<String>,
}

/// A Network: an address space that spans locations.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "networking.datumapis.com",
    version = "v1alpha",
    kind = "Network",
    plural = "networks",
    namespaced,
    status = "NetworkStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    /// Address management of the network.
    #[serde(default)]
    pub ipam: NetworkIpam,
    /// IP families the network carries; defaults to `[IPv6]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_families: Option<Vec<IpFamily>>,
    /// MTU of the network, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<i32>,
}

/// Observed state of a Network (conditions `IPAMAllocated`, `Ready`). Never mirrored.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct NetworkStatus {
    /// Conditions of the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// A NetworkContext: a Network realised in one location.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "networking.datumapis.com",
    version = "v1alpha",
    kind = "NetworkContext",
    plural = "networkcontexts",
    namespaced,
    status = "NetworkContextStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkContextSpec {
    /// The Network this context realises.
    pub network: LocalObjectReference,
    /// The location the context is realised in.
    pub location: LocationReference,
    /// IP families, copied from the Network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_families: Option<Vec<IpFamily>>,
    /// MTU in bytes, copied from the Network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<i32>,
    /// The Network generation this context was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_generation: Option<i64>,
}

/// Observed state of a NetworkContext (condition `Ready`). Never mirrored.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct NetworkContextStatus {
    /// Conditions of the context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// A Subnet: a prefix of a NetworkContext.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "networking.datumapis.com",
    version = "v1alpha",
    kind = "Subnet",
    plural = "subnets",
    namespaced,
    status = "SubnetStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct SubnetSpec {
    /// Class of the subnet, for example `private`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet_class: Option<String>,
    /// The NetworkContext this subnet belongs to.
    pub network_context: LocalObjectReference,
    /// The location of the subnet.
    pub location: LocationReference,
    /// IP family of the prefix.
    pub ip_family: IpFamily,
    /// First address of the prefix.
    pub start_address: String,
    /// Prefix length in bits.
    pub prefix_length: i32,
}

/// Observed state of a Subnet (conditions `Allocated`, `Programmed`, `Ready`). Never mirrored.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
pub struct SubnetStatus {
    /// Conditions of the subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// An address of a NetworkInterface inside its network.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct InterfaceAddress {
    /// IP family of the address.
    pub family: IpFamily,
    /// The address with its prefix length (CIDR form).
    pub address: String,
    /// The gateway of the prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Whether this is the primary address of the family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<bool>,
    /// Address class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

/// An address of a NetworkInterface outside its network (never used for membership endpoints).
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct ExternalAddress {
    /// IP family of the address.
    pub family: IpFamily,
    /// The bare address.
    pub address: String,
    /// Address class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

/// A NetworkInterface: an interface on a Network bound to an instance in a cell.
///
/// Cells hold these; the hub holds their projections (copies without `spec.claimRef` and
/// `spec.attachmentMode`, status limited to `phase` and `conditions`).
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[kube(
    group = "networking.datumapis.com",
    version = "v1alpha",
    kind = "NetworkInterface",
    plural = "networkinterfaces",
    namespaced,
    status = "NetworkInterfaceStatus",
    printcolumn = r#"{"name":"Network","type":"string","jsonPath":".spec.network.name"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInterfaceSpec {
    /// The Network the interface is on.
    pub network: LocalObjectReference,
    /// The claim holding the interface (cell only; dropped from hub copies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<LocalObjectReference>,
    /// Interface name inside the instance (at most 15 characters, default `eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 15))]
    pub interface_name: Option<String>,
    /// How the interface is attached (cell only; dropped from hub copies), default `Netns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment_mode: Option<String>,
    /// MTU in bytes (1300–8856).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1300, max = 8856))]
    pub mtu: Option<i32>,
    /// Addresses inside the network (at most 4, one per family).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4))]
    pub addresses: Option<Vec<InterfaceAddress>>,
    /// Addresses outside the network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_addresses: Option<Vec<ExternalAddress>>,
    /// What happens to the interface when its claim goes: `Delete` or `Retain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_policy: Option<String>,
}

/// A typed reference to the object an interface is attached to.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TypedReference {
    /// API group of the referent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_group: Option<String>,
    /// Kind of the referent.
    pub kind: String,
    /// Name of the referent.
    pub name: String,
}

/// Observed state of a NetworkInterface.
///
/// `phase` is `Available` or `Bound`; conditions include `Allocated`, `Prepared`, `Programmed`
/// and `HolderAvailable` (written only by the holder, read by NetworkService membership).
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInterfaceStatus {
    /// `Available` or `Bound`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The NetworkContext the interface was allocated from (cell only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_context_ref: Option<LocalObjectReference>,
    /// What the interface is attached to (cell only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment_ref: Option<TypedReference>,
    /// The VPC identifier of the network (cell only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vpc: Option<String>,
    /// Conditions of the interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// Which NetworkInterfaces a NetworkService selects.
#[derive(Clone, Debug, Default, Deserialize, Serialize, KubeSchema, PartialEq)]
#[x_kube(validation = Rule::new(
    "(has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0) || (has(self.selector.matchExpressions) && size(self.selector.matchExpressions) > 0)"
).message("selector must set matchLabels or matchExpressions: an empty selector would select every interface"))]
pub struct NetworkInterfaceSelection {
    /// Label selector over NetworkInterface copies in the service's namespace; never empty.
    pub selector: LabelSelector,
}

/// Transport protocol of a service port. Single-valued today; later values are additive.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum Protocol {
    /// TCP, the default.
    #[default]
    TCP,
}

/// One port of a NetworkService.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct ServicePort {
    /// Port name, a DNS label of at most 15 characters; unique within the service.
    #[schemars(length(min = 1, max = 15), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,
    /// Port number (1–65535); unique within the service.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Protocol, `TCP` by default.
    #[serde(default)]
    pub protocol: Protocol,
    /// Application protocol carried as `appProtocol` on every EndpointSlice port of this
    /// service port (a gateway reads it to pick how it speaks to the members): an IANA service
    /// name or a `domain/name` qualified name; `http` when absent.
    #[serde(default, rename = "appProtocol", skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"),
        extend("default" = "http")
    )]
    pub app_protocol: Option<String>,
}

/// The `appProtocol` of a service port that names none.
pub const DEFAULT_APP_PROTOCOL: &str = "http";

impl ServicePort {
    /// The port's application protocol: `appProtocol`, else [`DEFAULT_APP_PROTOCOL`].
    pub fn app_protocol(&self) -> &str {
        self.app_protocol.as_deref().unwrap_or(DEFAULT_APP_PROTOCOL)
    }
}

/// How traffic is spread over a service's locations. Single-valued today; additive later.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub enum TrafficStrategy {
    /// Each edge serves from the nearest serving location.
    #[default]
    Nearest,
}

/// Traffic distribution of a NetworkService.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct TrafficDistribution {
    /// The strategy, `Nearest` by default.
    #[serde(default)]
    pub strategy: TrafficStrategy,
}

/// A NetworkService: a named set of endpoints spanning every location its members run in
/// (seed 000). Members are Bound NetworkInterface copies on the hub matching the
/// selector; `replicator membership` writes the status and the EndpointSlices.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, KubeSchema, PartialEq)]
#[kube(
    group = "networking.datumapis.com",
    version = "v1alpha",
    kind = "NetworkService",
    plural = "networkservices",
    namespaced,
    status = "NetworkServiceStatus",
    printcolumn = r#"{"name":"Locations","type":"integer","jsonPath":".status.summary.locations"}"#,
    printcolumn = r#"{"name":"Members","type":"integer","jsonPath":".status.summary.members"}"#,
    printcolumn = r#"{"name":"Healthy","type":"integer","jsonPath":".status.summary.healthy"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#
)]
#[kube(validation = Rule::new("size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("a NetworkService name must be a DNS label (at most 63 lowercase letters, digits and '-'): its EndpointSlice names are built from it"))]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.ports.all(p, self.ports.exists_one(q, q.name == p.name))").message("port names must be unique"))]
#[x_kube(validation = Rule::new("self.ports.all(p, self.ports.exists_one(q, q.port == p.port))").message("port numbers must be unique"))]
pub struct NetworkServiceSpec {
    /// The interfaces that are members.
    pub network_interfaces: NetworkInterfaceSelection,
    /// The service's ports (1–16).
    #[schemars(length(min = 1, max = 16))]
    pub ports: Vec<ServicePort>,
    /// Traffic distribution; `Nearest` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_distribution: Option<TrafficDistribution>,
}

/// Member counts of a service.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct ServiceSummary {
    /// Distinct locations with members (all of them, even past the 64 listed).
    pub locations: i32,
    /// Members, located or not.
    pub members: i32,
    /// Located members whose holder reports `HolderAvailable` True.
    pub healthy: i32,
}

/// Member counts of one location.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq, Eq)]
pub struct LocationStatus {
    /// The location (`networking.datumapis.com/location` of the members).
    pub name: String,
    /// Members in the location.
    pub members: i32,
    /// Healthy members in the location.
    pub healthy: i32,
    /// Whether the location serves: `healthy > 0`.
    pub serving: bool,
}

/// Observed state of a NetworkService.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkServiceStatus {
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Counts over all members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<ServiceSummary>,
    /// Per-location counts, sorted by name, at most 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub locations: Option<Vec<LocationStatus>>,
    /// `MembersResolved` and `Ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// Every CRD the project defines, in a stable order (the order of `config/crds/`).
pub fn crds() -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> {
    vec![
        Network::crd(),
        NetworkContext::crd(),
        Subnet::crd(),
        NetworkInterface::crd(),
        NetworkService::crd(),
    ]
}

/// Renders every CRD as one multi-document YAML stream, the content of `config/crds/`.
///
/// # Errors
/// Fails only if a CRD cannot be serialized, which would be a bug in the derive output.
pub fn crds_yaml() -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crds_match_the_rust_types() {
        let generated = crds_yaml().unwrap();
        let committed = include_str!("../../config/crds/crds.yaml");
        assert!(
            generated == committed,
            "config/crds/crds.yaml drifted from the Rust types; regenerate with \
             `cargo run -p replicator -- crds > config/crds/crds.yaml`"
        );
    }

    #[test]
    fn every_crd_is_namespaced_v1alpha_with_a_status_subresource() {
        for crd in crds() {
            assert_eq!(crd.spec.group, GROUP);
            assert_eq!(crd.spec.scope, "Namespaced");
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, VERSION);
            assert!(version.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some());
        }
    }
}
