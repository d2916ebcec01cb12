//! The EndpointSlices gateways route to, per NetworkService port. Pure: no I/O (docs/architecture.md).
//!
//! Per port and per address family present among the members: one endpoint per member (its
//! first internal address of that family, canonical text, never an external address), zone =
//! location, ready = serving = healthy, terminating false, sharded at 100 endpoints. IPv6 (the
//! platform's default family) takes the base name `<service>-<port>` with shards
//! `<service>-<port>-<i>`; IPv4 takes `<service>-<port>-ipv4` and `<service>-<port>-ipv4-<i>`.
//! With no member address at all, one empty IPv6 slice `<service>-<port>` is still published:
//! a gateway's backendRef names it, and a missing slice would fail its whole route loop (seed 000,
//! "A NetworkService that resolves no members still gets an EndpointSlice"). Every shard carries
//! `kubernetes.io/service-name` (the base name) and `networking.datumapis.com/network-service`,
//! and is owned by the NetworkService, so it goes with it.

use std::{collections::BTreeMap, net::IpAddr};

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

/// `name` bounded to 253 characters, with a hash in place of the cut.
fn object_name(name: String) -> String {
    if name.len() <= 253 {
        return name;
    }
    let digest = Sha256::digest(name.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{hash}", name[..236].trim_end_matches(['-', '.']))
}

/// The slices `service` should have for `members` (sorted by name), with `extra_labels` (the
/// namespace's project routing labels) on each. Deterministic: equal input, equal output.
pub fn desired(
    service: &NetworkService,
    members: &[Member],
    extra_labels: &BTreeMap<String, String>,
) -> Vec<EndpointSlice> {
    let service_name = service.metadata.name.clone().unwrap_or_default();
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
        let base = format!("{service_name}-{}", port.name);
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
            app_protocol: None,
        };
        let mut any = false;
        for (family, suffix) in [("IPv6", ""), ("IPv4", "-ipv4")] {
            let endpoints: Vec<Endpoint> = members
                .iter()
                .filter_map(|m| {
                    let ip = m
                        .addresses
                        .iter()
                        .find(|ip| matches!((family, ip), ("IPv6", IpAddr::V6(_)) | ("IPv4", IpAddr::V4(_))))?;
                    Some(endpoint(m, *ip, namespace.as_deref()))
                })
                .collect();
            if endpoints.is_empty() {
                continue;
            }
            any = true;
            for (i, chunk) in endpoints.chunks(MAX_ENDPOINTS).enumerate() {
                let name = if i == 0 {
                    format!("{base}{suffix}")
                } else {
                    format!("{base}{suffix}-{i}")
                };
                slices.push(slice(
                    object_name(name),
                    &namespace,
                    &labels,
                    &owner,
                    family,
                    chunk.to_vec(),
                    &endpoint_port,
                ));
            }
        }
        if !any {
            slices.push(slice(
                object_name(base),
                &namespace,
                &labels,
                &owner,
                "IPv6",
                vec![],
                &endpoint_port,
            ));
        }
    }
    slices
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
    family: &str,
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
        address_type: family.into(),
        endpoints,
        ports: Some(vec![port.clone()]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{NetworkInterfaceSelection, NetworkServiceSpec, ServicePort};

    fn service(ports: &[(&str, i32)]) -> NetworkService {
        let mut s = NetworkService::new(
            "api",
            NetworkServiceSpec {
                network_interfaces: NetworkInterfaceSelection::default(),
                ports: ports
                    .iter()
                    .map(|(n, p)| ServicePort {
                        name: (*n).into(),
                        port: *p,
                        protocol: Protocol::TCP,
                    })
                    .collect(),
                traffic_distribution: None,
            },
        );
        s.metadata.namespace = Some("ns".into());
        s.metadata.uid = Some("uid-1".into());
        s
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

    #[test]
    fn one_slice_per_port_with_zone_readiness_and_labels() {
        let members = [
            m("a", Some("dfw"), true, &["fd00::1"]),
            m("b", Some("sjc"), false, &["fd00::2"]),
        ];
        let routing = BTreeMap::from([("meta.datumapis.com/upstream-cluster-name".to_owned(), "c".to_owned())]);
        let slices = desired(&service(&[("http", 80), ("grpc", 9090)]), &members, &routing);
        let names: Vec<_> = slices.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["api-http", "api-grpc"]);
        let s = &slices[0];
        assert_eq!(s.address_type, "IPv6");
        assert_eq!(s.endpoints.len(), 2);
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
        assert_eq!(labels["meta.datumapis.com/upstream-cluster-name"], "c");
        let owner = &s.metadata.owner_references.clone().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("NetworkService", "api", Some(true))
        );
        assert_eq!(s.ports.clone().unwrap()[0].port, Some(80));
    }

    #[test]
    fn two_hundred_fifty_members_make_three_shards() {
        let members: Vec<_> = (0..250)
            .map(|i| m(&format!("m{i:03}"), Some("dfw"), true, &[&format!("fd00::{:x}", i + 1)]))
            .collect();
        let slices = desired(&service(&[("http", 80)]), &members, &BTreeMap::new());
        let shape: Vec<_> = slices
            .iter()
            .map(|s| (s.metadata.name.clone().unwrap(), s.endpoints.len()))
            .collect();
        assert_eq!(
            shape,
            [
                ("api-http".into(), 100),
                ("api-http-1".into(), 100),
                ("api-http-2".into(), 50)
            ]
        );
        assert!(
            slices
                .iter()
                .all(|s| s.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL] == "api-http")
        );
    }

    #[test]
    fn dual_stack_members_give_one_slice_set_per_family() {
        let members = [
            m("a", Some("dfw"), true, &["fd00::1", "10.0.0.1"]),
            m("b", Some("dfw"), true, &["10.0.0.2"]),
        ];
        let slices = desired(&service(&[("http", 80)]), &members, &BTreeMap::new());
        let shape: Vec<_> = slices
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone().unwrap(),
                    s.address_type.clone(),
                    s.endpoints.len(),
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                ("api-http".into(), "IPv6".into(), 1),
                ("api-http-ipv4".into(), "IPv4".into(), 2)
            ]
        );
    }

    #[test]
    fn no_members_still_publish_one_empty_slice() {
        let slices = desired(&service(&[("http", 80)]), &[], &BTreeMap::new());
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].metadata.name.as_deref(), Some("api-http"));
        assert!(slices[0].endpoints.is_empty());
    }

    #[test]
    fn unlocated_members_have_no_zone_and_long_names_stay_valid() {
        let mut s = service(&[("http", 80)]);
        s.metadata.name = Some("s".repeat(70));
        let slices = desired(&s, &[m("a", None, true, &["fd00::1"])], &BTreeMap::new());
        assert_eq!(slices[0].endpoints[0].zone, None);
        let labels = slices[0].metadata.labels.clone().unwrap();
        assert!(labels[SERVICE_NAME_LABEL].len() <= 63);
        assert!(labels[NETWORK_SERVICE_LABEL].len() <= 63);
    }
}
