//! The EndpointSlices gateways route to, per NetworkService port. Pure: no I/O (docs/architecture.md).
//!
//! Per port and per address family: one endpoint per member (its first internal address of that
//! family, canonical text, never an external address), zone = location, ready = serving =
//! healthy, terminating false, sharded at [`MAX_ENDPOINTS`]. Names ([`slice_name`]):
//!
//! - shard 0 of IPv6 (the fabric's family) is `<service>-<port>`, the name a gateway's
//!   backendRef resolves. It is published for every port whatever the members' families, empty
//!   when no member has an IPv6 address: a backendRef that resolves to nothing would stop the
//!   gateway reprogramming every other route;
//! - every other (family, shard) is `<service>.<port>.<family>[-<shard>]` (`api.http.ipv4`,
//!   `api.http.ipv6-1`, `api.http.ipv4-2`). A service name is a DNS label and a port name is
//!   lowercase alphanumerics and `-`, so neither holds a `.`: these names have exactly two dots
//!   (they cannot equal a base name, which has none), and splitting at the dots gives back the
//!   service, the port, the family and the shard, so no two tuples share one. Only base names can
//!   meet (`a-b` port `c` and `a` port `b-c` are both `a-b-c`): that is the name gateways know,
//!   and the controller never overwrites a slice that belongs to another service or port.
//!
//! IPv4 slices exist only while a member has an IPv4 address. Every slice carries
//! `kubernetes.io/service-name` (the base name), `networking.datumapis.com/network-service`, the
//! port's `appProtocol` (default `http`), and is owned by the NetworkService, so it goes with it.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use sha2::{Digest, Sha256};

use super::rollup::Member;
use crate::api::{NetworkService, Protocol};

/// Endpoints per slice.
pub const MAX_ENDPOINTS: usize = 100;
/// Label naming the service on every slice it owns.
pub const NETWORK_SERVICE_LABEL: &str = "networking.datumapis.com/network-service";
/// Standard label grouping the shards of one port.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Standard label naming the slices' manager.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// This controller's `managed-by` value.
pub const MANAGED_BY: &str = "membership.replicator.datumapis.com";

/// An EndpointSlice address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv6, the fabric's family: shard 0 carries the base name.
    IPv6,
    /// IPv4.
    IPv4,
}

impl Family {
    /// The `addressType` value (`IPv6`, `IPv4`).
    pub fn address_type(self) -> &'static str {
        match self {
            Family::IPv6 => "IPv6",
            Family::IPv4 => "IPv4",
        }
    }

    /// The family's tag in slice names (`ipv6`, `ipv4`).
    fn tag(self) -> &'static str {
        match self {
            Family::IPv6 => "ipv6",
            Family::IPv4 => "ipv4",
        }
    }

    fn holds(self, ip: &IpAddr) -> bool {
        matches!(
            (self, ip),
            (Family::IPv6, IpAddr::V6(_)) | (Family::IPv4, IpAddr::V4(_))
        )
    }
}

/// Why no slices can be planned for a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// The service name is not a DNS label (the CRD rejects such names; an object stored under
    /// an older CRD can still carry one). Slice names built from it could meet another service's.
    ServiceName(String),
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::ServiceName(name) => write!(
                f,
                "service name {name:?} is not a DNS label (lowercase letters, digits and '-', at most 63): no EndpointSlice is published"
            ),
        }
    }
}

impl std::error::Error for PlanError {}

/// Whether `s` is a DNS-1123 label: 1–63 lowercase alphanumerics or `-`, alphanumeric at both
/// ends.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    (1..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first() != Some(&b'-')
        && b.last() != Some(&b'-')
}

/// The name of shard `shard` (0-based) of `family` for `port` of `service`: `<service>-<port>`
/// for IPv6 shard 0, else `<service>.<port>.<ipv6|ipv4>[-<shard>]` (no `-0`). For a service
/// name that is a DNS label and a port name of lowercase alphanumerics and `-` (what the CRD
/// admits), the result is a DNS-1123 subdomain of at most 63 + 1 + 15 + 1 + 4 + 1 + 20 = 105
/// characters, and two distinct tuples give one name only when both are IPv6 shard 0 and
/// `<service>-<port>` coincides (see the module documentation).
pub fn slice_name(service: &str, port: &str, family: Family, shard: usize) -> String {
    match (family, shard) {
        (Family::IPv6, 0) => format!("{service}-{port}"),
        (_, 0) => format!("{service}.{port}.{}", family.tag()),
        (_, n) => format!("{service}.{port}.{}-{n}", family.tag()),
    }
}

/// `s` if it is a valid label value length, else a stable 63-character form with a hash.
fn label_value(s: &str) -> String {
    if s.len() <= 63 {
        return s.to_owned();
    }
    let digest = Sha256::digest(s.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let head = s[..46].trim_end_matches(['-', '.', '_']);
    format!("{head}-{hash}")
}

/// The slices `service` should have for `members` (sorted by name), with `extra_labels` (the
/// namespace's project routing labels) on each: per port, IPv6 shard 0 first (always), then
/// further IPv6 shards, then the IPv4 shards. Deterministic: equal input, equal output.
///
/// # Errors
/// [`PlanError::ServiceName`] when the service name is not a DNS label.
pub fn desired(
    service: &NetworkService,
    members: &[Member],
    extra_labels: &BTreeMap<String, String>,
) -> Result<Vec<EndpointSlice>, PlanError> {
    let service_name = service.metadata.name.clone().unwrap_or_default();
    if !is_dns_label(&service_name) {
        return Err(PlanError::ServiceName(service_name));
    }
    let namespace = service.metadata.namespace.clone();
    let owner = OwnerReference {
        api_version: format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
        kind: "NetworkService".into(),
        name: service_name.clone(),
        uid: service.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let mut slices = Vec::new();
    for port in &service.spec.ports {
        let base = slice_name(&service_name, &port.name, Family::IPv6, 0);
        let mut labels = extra_labels.clone();
        labels.insert(SERVICE_NAME_LABEL.into(), label_value(&base));
        labels.insert(NETWORK_SERVICE_LABEL.into(), label_value(&service_name));
        labels.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
        let endpoint_port = EndpointPort {
            name: Some(port.name.clone()),
            port: Some(port.port),
            protocol: Some(match port.protocol {
                Protocol::TCP => "TCP".into(),
            }),
            app_protocol: Some(port.app_protocol().to_owned()),
        };
        for family in [Family::IPv6, Family::IPv4] {
            let endpoints: Vec<Endpoint> = members
                .iter()
                .filter_map(|m| {
                    let ip = m.addresses.iter().find(|ip| family.holds(ip))?;
                    Some(endpoint(m, *ip, namespace.as_deref()))
                })
                .collect();
            let mut chunks: Vec<Vec<Endpoint>> = endpoints.chunks(MAX_ENDPOINTS).map(<[_]>::to_vec).collect();
            if chunks.is_empty() && family == Family::IPv6 {
                chunks.push(Vec::new());
            }
            for (shard, chunk) in chunks.into_iter().enumerate() {
                slices.push(slice(
                    slice_name(&service_name, &port.name, family, shard),
                    &namespace,
                    &labels,
                    &owner,
                    family,
                    chunk,
                    &endpoint_port,
                ));
            }
        }
    }
    Ok(slices)
}

fn endpoint(m: &Member, ip: IpAddr, namespace: Option<&str>) -> Endpoint {
    Endpoint {
        addresses: vec![ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(m.healthy),
            serving: Some(m.healthy),
            terminating: Some(false),
        }),
        zone: m.location.clone(),
        target_ref: Some(ObjectReference {
            api_version: Some(format!("{}/{}", crate::api::GROUP, crate::api::VERSION)),
            kind: Some("NetworkInterface".into()),
            name: Some(m.name.clone()),
            namespace: namespace.map(str::to_owned),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}

fn slice(
    name: String,
    namespace: &Option<String>,
    labels: &BTreeMap<String, String>,
    owner: &OwnerReference,
    family: Family,
    endpoints: Vec<Endpoint>,
    port: &EndpointPort,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: namespace.clone(),
            labels: Some(labels.clone()),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        address_type: family.address_type().into(),
        endpoints,
        ports: Some(vec![port.clone()]),
    }
}

/// Who holds an existing slice, as far as [`ownership`] can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// No slice of that name.
    Free,
    /// Ours: written by this controller for this service.
    Ours,
    /// Someone else's (another service, another manager, a hand-made slice), described for the
    /// service's condition and Event. Never overwritten.
    Taken(String),
}

/// Whether the existing slice `current` (if any) may be written for the service named
/// `service_name` with UID `service_uid`. It is ours when its
/// `endpointslice.kubernetes.io/managed-by` label is this controller's and either its
/// controller owner reference is this service (same UID) or, having no controller, its
/// `networking.datumapis.com/network-service` label names this service. Anything else is taken:
/// a slice of another service whose base name coincides (`a-b` port `c`, `a` port `b-c`), a
/// slice of a service since re-created (another UID; the garbage collector removes it), a slice
/// another manager or a person made.
pub fn ownership(current: Option<&EndpointSlice>, service_name: &str, service_uid: &str) -> Ownership {
    let Some(current) = current else {
        return Ownership::Free;
    };
    let name = current.metadata.name.as_deref().unwrap_or_default();
    let labels = current.metadata.labels.clone().unwrap_or_default();
    let label = |k: &str| labels.get(k).map(String::as_str);
    if label(MANAGED_BY_LABEL) != Some(MANAGED_BY) {
        return Ownership::Taken(match label(MANAGED_BY_LABEL) {
            Some(manager) => format!("EndpointSlice {name} is managed by {manager}"),
            None => format!("EndpointSlice {name} exists and is not managed by this controller"),
        });
    }
    let controller = current
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    match controller {
        Some(owner) if owner.kind == "NetworkService" && owner.uid == service_uid => Ownership::Ours,
        Some(owner) if owner.kind == "NetworkService" && owner.name == service_name => Ownership::Taken(format!(
            "EndpointSlice {name} belongs to an earlier NetworkService {service_name} (UID {}); it goes with it",
            owner.uid
        )),
        Some(owner) => Ownership::Taken(format!("EndpointSlice {name} belongs to {} {}", owner.kind, owner.name)),
        None if label(NETWORK_SERVICE_LABEL) == Some(label_value(service_name).as_str()) => Ownership::Ours,
        None => Ownership::Taken(format!(
            "EndpointSlice {name} belongs to NetworkService {}",
            label(NETWORK_SERVICE_LABEL).unwrap_or("(none)")
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::api::{NetworkInterfaceSelection, NetworkServiceSpec, ServicePort};

    fn service_named(name: &str, ports: &[(&str, i32)]) -> NetworkService {
        let mut s = NetworkService::new(
            name,
            NetworkServiceSpec {
                network_interfaces: NetworkInterfaceSelection::default(),
                ports: ports
                    .iter()
                    .map(|(n, p)| ServicePort {
                        name: (*n).into(),
                        port: *p,
                        protocol: Protocol::TCP,
                        app_protocol: None,
                    })
                    .collect(),
                traffic_distribution: None,
            },
        );
        s.metadata.namespace = Some("ns".into());
        s.metadata.uid = Some("uid-1".into());
        s
    }

    fn service(ports: &[(&str, i32)]) -> NetworkService {
        service_named("api", ports)
    }

    fn m(name: &str, location: Option<&str>, healthy: bool, addrs: &[&str]) -> Member {
        Member {
            name: name.into(),
            network: "net".into(),
            location: location.map(Into::into),
            healthy,
            addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    /// (name, addressType, endpoint count) of each slice, in order.
    type Shape = Vec<(String, String, usize)>;

    fn shape(slices: &[EndpointSlice]) -> Shape {
        slices
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone().unwrap(),
                    s.address_type.clone(),
                    s.endpoints.len(),
                )
            })
            .collect()
    }

    fn row(name: &str, family: &str, n: usize) -> (String, String, usize) {
        (name.into(), family.into(), n)
    }

    #[test]
    fn one_slice_per_port_with_zone_readiness_labels_and_app_protocol() {
        let members = [
            m("a", Some("dfw"), true, &["fd00::1"]),
            m("b", Some("sjc"), false, &["fd00::2"]),
        ];
        let routing = BTreeMap::from([("meta.datumapis.com/upstream-cluster-name".to_owned(), "c".to_owned())]);
        let mut svc = service(&[("http", 80), ("grpc", 9090)]);
        svc.spec.ports[1].app_protocol = Some("kubernetes.io/h2c".into());
        let slices = desired(&svc, &members, &routing).unwrap();
        assert_eq!(shape(&slices), [row("api-http", "IPv6", 2), row("api-grpc", "IPv6", 2)]);
        let s = &slices[0];
        assert_eq!(s.endpoints[0].addresses, ["fd00::1"]);
        assert_eq!(s.endpoints[0].zone.as_deref(), Some("dfw"));
        let c = s.endpoints[1].conditions.clone().unwrap();
        assert_eq!(
            (c.ready, c.serving, c.terminating),
            (Some(false), Some(false), Some(false))
        );
        let labels = s.metadata.labels.clone().unwrap();
        assert_eq!(labels[SERVICE_NAME_LABEL], "api-http");
        assert_eq!(labels[NETWORK_SERVICE_LABEL], "api");
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGED_BY);
        assert_eq!(labels["meta.datumapis.com/upstream-cluster-name"], "c");
        let owner = &s.metadata.owner_references.clone().unwrap()[0];
        assert_eq!(
            (
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str(),
                owner.controller
            ),
            ("NetworkService", "api", "uid-1", Some(true))
        );
        assert_eq!(
            s.ports.clone().unwrap(),
            [EndpointPort {
                name: Some("http".into()),
                port: Some(80),
                protocol: Some("TCP".into()),
                app_protocol: Some("http".into()),
            }],
            "appProtocol defaults to http"
        );
        assert_eq!(
            slices[1].ports.clone().unwrap()[0].app_protocol.as_deref(),
            Some("kubernetes.io/h2c")
        );
    }

    #[test]
    fn two_hundred_fifty_members_make_three_shards() {
        let members: Vec<_> = (0..250)
            .map(|i| m(&format!("m{i:03}"), Some("dfw"), true, &[&format!("fd00::{:x}", i + 1)]))
            .collect();
        let slices = desired(&service(&[("http", 80)]), &members, &BTreeMap::new()).unwrap();
        assert_eq!(
            shape(&slices),
            [
                row("api-http", "IPv6", 100),
                row("api.http.ipv6-1", "IPv6", 100),
                row("api.http.ipv6-2", "IPv6", 50)
            ]
        );
        assert!(
            slices
                .iter()
                .all(|s| s.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL] == "api-http")
        );
        // Members keep their order across shards: the 101st is the first of shard 1.
        assert_eq!(slices[1].endpoints[0].addresses, ["fd00::65"]);
    }

    #[test]
    fn every_family_mix_keeps_the_ipv6_base_slice() {
        let v6 = m("a", Some("dfw"), true, &["fd00::1"]);
        let v4 = m("b", Some("dfw"), true, &["10.0.0.2"]);
        let dual = m("c", Some("dfw"), true, &["10.0.0.3", "fd00::3"]);
        let cases: Vec<(&str, Vec<Member>, Shape)> = vec![
            ("no members", vec![], vec![row("api-http", "IPv6", 0)]),
            ("IPv6 only", vec![v6.clone()], vec![row("api-http", "IPv6", 1)]),
            (
                "IPv4 only",
                vec![v4.clone()],
                vec![row("api-http", "IPv6", 0), row("api.http.ipv4", "IPv4", 1)],
            ),
            (
                "dual-stack member",
                vec![dual.clone()],
                vec![row("api-http", "IPv6", 1), row("api.http.ipv4", "IPv4", 1)],
            ),
            (
                "mixed",
                vec![v6, v4, dual],
                vec![row("api-http", "IPv6", 2), row("api.http.ipv4", "IPv4", 2)],
            ),
            (
                "member without addresses",
                vec![m("d", Some("dfw"), true, &[])],
                vec![row("api-http", "IPv6", 0)],
            ),
        ];
        for (what, members, want) in cases {
            let slices = desired(&service(&[("http", 80)]), &members, &BTreeMap::new()).unwrap();
            assert_eq!(shape(&slices), want, "{what}");
        }
    }

    #[test]
    fn ipv4_shards_and_the_first_address_of_each_family() {
        let members: Vec<_> = (0..101)
            .map(|i| {
                m(
                    &format!("m{i:03}"),
                    Some("dfw"),
                    true,
                    &[&format!("10.0.{}.{}", i / 200, i % 200 + 1), "10.9.9.9"],
                )
            })
            .collect();
        let slices = desired(&service(&[("http", 80)]), &members, &BTreeMap::new()).unwrap();
        assert_eq!(
            shape(&slices),
            [
                row("api-http", "IPv6", 0),
                row("api.http.ipv4", "IPv4", 100),
                row("api.http.ipv4-1", "IPv4", 1)
            ]
        );
        assert_eq!(
            slices[1].endpoints[0].addresses,
            ["10.0.0.1"],
            "the first IPv4 address only"
        );
    }

    #[test]
    fn names_that_collided_before_are_distinct() {
        // Port `http-ipv4` against the IPv4 set of `http`; port `http-1` against shard 1 of
        // `http`; service `a-b` port `c` against service `a` port `b-c` (only the base name,
        // which the ownership check guards).
        assert_ne!(
            slice_name("api", "http-ipv4", Family::IPv6, 0),
            slice_name("api", "http", Family::IPv4, 0)
        );
        assert_ne!(
            slice_name("api", "http-1", Family::IPv6, 0),
            slice_name("api", "http", Family::IPv6, 1)
        );
        assert_eq!(
            slice_name("a-b", "c", Family::IPv6, 0),
            slice_name("a", "b-c", Family::IPv6, 0)
        );
        assert_ne!(
            slice_name("a-b", "c", Family::IPv4, 0),
            slice_name("a", "b-c", Family::IPv4, 0)
        );
        assert_ne!(
            slice_name("a-b", "c", Family::IPv6, 1),
            slice_name("a", "b-c", Family::IPv6, 1)
        );
        assert_eq!(slice_name("api", "http", Family::IPv4, 0), "api.http.ipv4");
        assert_eq!(slice_name("api", "http", Family::IPv4, 3), "api.http.ipv4-3");
        assert_eq!(slice_name("api", "http", Family::IPv6, 2), "api.http.ipv6-2");
    }

    #[test]
    fn a_service_name_that_is_not_a_dns_label_plans_nothing() {
        for bad in ["a.b", "A", "-a", "a-", "", &"a".repeat(64)] {
            assert_eq!(
                desired(&service_named(bad, &[("http", 80)]), &[], &BTreeMap::new()),
                Err(PlanError::ServiceName(bad.to_owned())),
                "{bad:?}"
            );
        }
        let longest = "s".repeat(63);
        let slices = desired(
            &service_named(&longest, &[("abcdefghijklmno", 80)]),
            &[m("a", None, true, &["fd00::1"])],
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(slices[0].endpoints[0].zone, None, "an unlocated member has no zone");
        let labels = slices[0].metadata.labels.clone().unwrap();
        assert_eq!(
            labels[SERVICE_NAME_LABEL].len(),
            63,
            "the base name's label is hashed to 63"
        );
        assert_ne!(labels[SERVICE_NAME_LABEL], slices[0].metadata.name.clone().unwrap());
        assert_eq!(labels[NETWORK_SERVICE_LABEL], longest);
    }

    fn existing(name: &str, labels: &[(&str, &str)], owner: Option<(&str, &str, &str)>) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()),
                owner_references: owner.map(|(kind, name, uid)| {
                    vec![OwnerReference {
                        kind: kind.into(),
                        name: name.into(),
                        uid: uid.into(),
                        controller: Some(true),
                        ..OwnerReference::default()
                    }]
                }),
                ..ObjectMeta::default()
            },
            address_type: "IPv6".into(),
            ..EndpointSlice::default()
        }
    }

    #[test]
    fn ownership_of_an_existing_slice() {
        let ours = [(MANAGED_BY_LABEL, MANAGED_BY), (NETWORK_SERVICE_LABEL, "a-b")];
        let cases: Vec<(&str, Option<EndpointSlice>, Ownership)> = vec![
            ("absent", None, Ownership::Free),
            (
                "ours by controller UID",
                Some(existing("a-b-c", &ours, Some(("NetworkService", "a-b", "uid-ab")))),
                Ownership::Ours,
            ),
            (
                "ours, no controller yet",
                Some(existing("a-b-c", &ours, None)),
                Ownership::Ours,
            ),
            (
                "another service with the same base name",
                Some(existing(
                    "a-b-c",
                    &[(MANAGED_BY_LABEL, MANAGED_BY), (NETWORK_SERVICE_LABEL, "a")],
                    Some(("NetworkService", "a", "uid-a")),
                )),
                Ownership::Taken("EndpointSlice a-b-c belongs to NetworkService a".into()),
            ),
            (
                "another service, no controller",
                Some(existing(
                    "a-b-c",
                    &[(MANAGED_BY_LABEL, MANAGED_BY), (NETWORK_SERVICE_LABEL, "a")],
                    None,
                )),
                Ownership::Taken("EndpointSlice a-b-c belongs to NetworkService a".into()),
            ),
            (
                "an earlier service of the same name",
                Some(existing("a-b-c", &ours, Some(("NetworkService", "a-b", "uid-old")))),
                Ownership::Taken(
                    "EndpointSlice a-b-c belongs to an earlier NetworkService a-b (UID uid-old); it goes with it"
                        .into(),
                ),
            ),
            (
                "our labels, another kind controls it",
                Some(existing("a-b-c", &ours, Some(("Service", "a-b", "uid-ab")))),
                Ownership::Taken("EndpointSlice a-b-c belongs to Service a-b".into()),
            ),
            (
                "hand-made",
                Some(existing("a-b-c", &[], None)),
                Ownership::Taken("EndpointSlice a-b-c exists and is not managed by this controller".into()),
            ),
            (
                "another manager",
                Some(existing(
                    "a-b-c",
                    &[
                        (MANAGED_BY_LABEL, "endpointslice-controller.k8s.io"),
                        (NETWORK_SERVICE_LABEL, "a-b"),
                    ],
                    Some(("NetworkService", "a-b", "uid-ab")),
                )),
                Ownership::Taken("EndpointSlice a-b-c is managed by endpointslice-controller.k8s.io".into()),
            ),
        ];
        for (what, current, want) in cases {
            assert_eq!(ownership(current.as_ref(), "a-b", "uid-ab"), want, "{what}");
        }
    }

    /// A DNS-1123 subdomain as Kubernetes validates object names: at most 253 characters,
    /// dot-separated parts of lowercase alphanumerics and `-`, alphanumeric at both ends (no
    /// limit per part).
    fn is_dns_subdomain(s: &str) -> bool {
        s.len() <= 253
            && s.split('.').all(|part| {
                let b = part.as_bytes();
                !b.is_empty()
                    && b.iter()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                    && b[0] != b'-'
                    && b[b.len() - 1] != b'-'
            })
    }

    fn family() -> impl Strategy<Value = Family> {
        prop_oneof![Just(Family::IPv6), Just(Family::IPv4)]
    }

    proptest! {
        /// Names are injective over (service, port, family, shard) except where both are IPv6
        /// shard 0 and `<service>-<port>` coincides (the name gateways resolve, guarded by
        /// [`ownership`]), and every name is a DNS-1123 subdomain of at most 253 characters.
        /// Service and port names are drawn from small alphabets rich in `-` and digits (so
        /// that `a-b`/`c` against `a`/`b-c`, `http-1` and `http-ipv4` shapes come up), at the
        /// lengths the CRD admits.
        #[test]
        fn slice_names_are_injective_and_valid(
            tuples in prop::collection::vec(
                (
                    "[a-z0-9]([-a-z0-9i4pv]{0,61}[a-z0-9])?",
                    "[a-z0-9]([-a-z0-9i4pv]{0,13}[a-z0-9])?",
                    family(),
                    0usize..5,
                ),
                1..40,
            ),
            fixed in prop::collection::vec(
                (
                    prop::sample::select(vec!["a", "a-b", "api", "api-http", "x-1"]),
                    prop::sample::select(vec!["c", "b-c", "http", "http-1", "http-ipv4", "1", "ipv4", "ipv6-1"]),
                    family(),
                    0usize..3,
                ),
                0..40,
            ),
        ) {
            let all: Vec<(String, String, Family, usize)> = tuples
                .into_iter()
                .chain(fixed.into_iter().map(|(s, p, f, k)| (s.to_owned(), p.to_owned(), f, k)))
                .collect();
            let mut seen: HashMap<String, (String, String, Family, usize)> = HashMap::new();
            for t in all {
                let (service, port, family, shard) = &t;
                prop_assert!(is_dns_label(service));
                let name = slice_name(service, port, *family, *shard);
                prop_assert!(is_dns_subdomain(&name), "{name:?} is not a DNS-1123 subdomain");
                if let Some(other) = seen.get(&name) && other != &t {
                    let both_base = (*family, *shard) == (Family::IPv6, 0) && (other.2, other.3) == (Family::IPv6, 0);
                    prop_assert!(
                        both_base && format!("{service}-{port}") == format!("{}-{}", other.0, other.1),
                        "{t:?} and {other:?} share {name:?}"
                    );
                }
                seen.insert(name, t);
            }
        }

        /// Whatever the members' families, every port gets its IPv6 shard 0 under the base name,
        /// no slice holds more than 100 endpoints, and every member with an address of a family
        /// is in exactly one slice of that family.
        #[test]
        fn every_port_has_its_base_slice(
            v6 in 0usize..230,
            v4 in 0usize..230,
        ) {
            let mut members = Vec::new();
            for i in 0..v6.max(v4) {
                let mut addrs = Vec::new();
                if i < v6 { addrs.push(format!("fd00::{:x}", i + 1)); }
                if i < v4 { addrs.push(format!("10.0.{}.{}", i / 250, i % 250 + 1)); }
                let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
                members.push(m(&format!("m{i:03}"), Some("dfw"), true, &addrs));
            }
            let slices = desired(&service(&[("http", 80), ("http-ipv4", 81)]), &members, &BTreeMap::new()).unwrap();
            for port in ["http", "http-ipv4"] {
                let base = format!("api-{port}");
                let ours: Vec<&EndpointSlice> = slices
                    .iter()
                    .filter(|s| s.ports.as_ref().unwrap()[0].name.as_deref() == Some(port))
                    .collect();
                prop_assert_eq!(ours[0].metadata.name.as_deref(), Some(base.as_str()));
                prop_assert_eq!(ours[0].address_type.as_str(), "IPv6");
                for (fam, want) in [("IPv6", v6), ("IPv4", v4)] {
                    let n: usize = ours.iter().filter(|s| s.address_type == fam).map(|s| s.endpoints.len()).sum();
                    prop_assert_eq!(n, want);
                }
                prop_assert!(ours.iter().all(|s| s.endpoints.len() <= MAX_ENDPOINTS));
            }
            let names: std::collections::HashSet<_> = slices.iter().map(|s| s.metadata.name.clone()).collect();
            prop_assert_eq!(names.len(), slices.len());
        }
    }
}
