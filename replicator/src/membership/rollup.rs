//! NetworkService membership, health and per-location rollup. Pure: no I/O (docs/architecture.md).
//!
//! Rules (docs/architecture.md; seed 000):
//! - members are NetworkInterface copies in the service's namespace that match the selector and
//!   are in phase `Bound` (a retained, released interface never counts);
//! - a member is healthy when its `HolderAvailable` condition is True;
//! - its location is its `networking.datumapis.com/location` label; unlocated members count in
//!   `summary.members` only (never healthy, never in a location) and are named in the message;
//! - locations are sorted by name, at most 64 are listed (`summary.locations` counts them all);
//!   a location serves when it has a healthy member;
//! - `MembersResolved`: `InvalidSelector`, `NoMatchingInterfaces`, `MultipleNetworks` (naming the
//!   networks; status lists stay empty) or `Resolved`; `Ready` copies a MembersResolved failure,
//!   else `NoServingLocations`, else `Ready`. Transition times move only when a status changes.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};

use crate::api::{LocationStatus, NetworkInterface, NetworkServiceStatus, ServiceSummary};

/// Condition type: whether the selector resolved to members.
pub const MEMBERS_RESOLVED: &str = "MembersResolved";
/// Condition type: whether the service can serve.
pub const READY: &str = "Ready";
/// Most locations listed in `status.locations`.
pub const MAX_LOCATIONS: usize = 64;
/// Label holding a member's location.
pub const LOCATION_LABEL: &str = "networking.datumapis.com/location";
/// Condition a holder writes on an interface it holds; the only condition membership reads.
pub const HOLDER_AVAILABLE: &str = "HolderAvailable";

/// Condition type: whether every EndpointSlice of the service is in place.
pub const SLICES_PUBLISHED: &str = "SlicesPublished";

/// Reasons of the conditions.
pub mod reasons {
    /// The selector cannot be evaluated.
    pub const INVALID_SELECTOR: &str = "InvalidSelector";
    /// No Bound interface matches.
    pub const NO_MATCHING_INTERFACES: &str = "NoMatchingInterfaces";
    /// Members are on more than one network.
    pub const MULTIPLE_NETWORKS: &str = "MultipleNetworks";
    /// Members resolved.
    pub const RESOLVED: &str = "Resolved";
    /// No location has a healthy member.
    pub const NO_SERVING_LOCATIONS: &str = "NoServingLocations";
    /// At least one location serves.
    pub const READY: &str = "Ready";
    /// Every desired EndpointSlice is written and current.
    pub const PUBLISHED: &str = "Published";
    /// A desired slice name is held by a slice that is not this service's (named in the
    /// message); it is left untouched.
    pub const SLICE_NAME_CONFLICT: &str = "SliceNameConflict";
    /// The hub refused a slice (invalid, forbidden); the message names it and says why.
    pub const SLICE_REJECTED: &str = "SliceRejected";
    /// The service name cannot name slices (not a DNS label).
    pub const INVALID_SERVICE_NAME: &str = "InvalidServiceName";
    /// The slices are not written yet (the hub did not answer); retried with backoff.
    pub const PENDING: &str = "Pending";
}

/// What the last slice pass of a service achieved, as the controller saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlicesOutcome {
    /// Every desired slice is in place.
    Published,
    /// Slices whose names are taken by something else, one message each (left untouched).
    Conflicts(Vec<String>),
    /// Slices the hub refused, one message each (with conflicts, if any, first).
    Rejected(Vec<String>),
    /// The service name cannot name slices (the message says why).
    InvalidName(String),
    /// Not known: a transient failure (the message); the previous condition stands.
    Pending(String),
}

/// Adds `SlicesPublished` for `slices` to `status` (made by [`status`] for the same pass), and,
/// when the members resolved but the slices are not all in place, turns `Ready` False with the
/// slice reason: a gateway would resolve someone else's slice, or none. `Pending` keeps the
/// previous `SlicesPublished` (a hub hiccup does not flip it), or says `Pending` when there is
/// none. Transition times are kept as [`status`] keeps them.
pub fn with_slices(
    mut status: NetworkServiceStatus,
    slices: &SlicesOutcome,
    generation: Option<i64>,
    previous: Option<&NetworkServiceStatus>,
    now: Timestamp,
) -> NetworkServiceStatus {
    let now = Time(now);
    let previous_slices = previous
        .and_then(|p| p.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == SLICES_PUBLISHED));
    let list = |items: &[String]| {
        let mut text = items.iter().take(5).cloned().collect::<Vec<_>>().join("; ");
        if items.len() > 5 {
            text.push_str(&format!("; and {} more", items.len() - 5));
        }
        text
    };
    let published = match slices {
        SlicesOutcome::Published => condition(
            SLICES_PUBLISHED,
            true,
            reasons::PUBLISHED,
            "every EndpointSlice is in place".to_owned(),
            generation,
            previous,
            &now,
        ),
        SlicesOutcome::Conflicts(c) => condition(
            SLICES_PUBLISHED,
            false,
            reasons::SLICE_NAME_CONFLICT,
            format!("not overwritten: {}", list(c)),
            generation,
            previous,
            &now,
        ),
        SlicesOutcome::Rejected(r) => condition(
            SLICES_PUBLISHED,
            false,
            reasons::SLICE_REJECTED,
            list(r),
            generation,
            previous,
            &now,
        ),
        SlicesOutcome::InvalidName(m) => condition(
            SLICES_PUBLISHED,
            false,
            reasons::INVALID_SERVICE_NAME,
            m.clone(),
            generation,
            previous,
            &now,
        ),
        SlicesOutcome::Pending(m) => match previous_slices {
            Some(p) => Condition {
                observed_generation: generation,
                ..p.clone()
            },
            None => condition(
                SLICES_PUBLISHED,
                false,
                reasons::PENDING,
                format!("EndpointSlices not written yet: {m}"),
                generation,
                previous,
                &now,
            ),
        },
    };
    let conditions = status.conditions.get_or_insert_with(Vec::new);
    let resolved = conditions
        .iter()
        .any(|c| c.type_ == MEMBERS_RESOLVED && c.status == "True");
    if resolved && published.status != "True" {
        let ready = condition(
            READY,
            false,
            &published.reason,
            published.message.clone(),
            generation,
            previous,
            &now,
        );
        conditions.retain(|c| c.type_ != READY);
        conditions.push(ready);
    }
    conditions.retain(|c| c.type_ != SLICES_PUBLISHED);
    conditions.push(published);
    status
}

/// One member, reduced to what membership and endpoints need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Interface (copy) name.
    pub name: String,
    /// `spec.network.name`.
    pub network: String,
    /// Its location label, if any.
    pub location: Option<String>,
    /// `HolderAvailable` is True.
    pub healthy: bool,
    /// Internal addresses (`spec.addresses`, prefix stripped), primary first, in order.
    pub addresses: Vec<IpAddr>,
}

/// What a selector resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// The selector cannot be evaluated (message says why).
    InvalidSelector(String),
    /// No Bound interface matches.
    NoMatch,
    /// Members span these networks (sorted, distinct, more than one).
    MultipleNetworks(Vec<String>),
    /// Members, sorted by name.
    Resolved(Vec<Member>),
}

impl Resolution {
    /// The members, empty unless resolved.
    pub fn members(&self) -> &[Member] {
        match self {
            Self::Resolved(m) => m,
            _ => &[],
        }
    }
}

/// Whether `interface` is in phase Bound.
pub fn is_bound(interface: &NetworkInterface) -> bool {
    interface.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

/// Whether `interface` reports `HolderAvailable` True.
pub fn is_healthy(interface: &NetworkInterface) -> bool {
    interface
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == HOLDER_AVAILABLE && c.status == "True"))
}

/// The member view of an interface (internal addresses only, canonical, primary first).
pub fn member(interface: &NetworkInterface) -> Member {
    let mut addresses: Vec<(bool, IpAddr)> = interface
        .spec
        .addresses
        .iter()
        .flatten()
        .filter_map(|a| {
            let bare = a.address.split('/').next().unwrap_or_default();
            bare.parse::<IpAddr>().ok().map(|ip| (a.primary != Some(true), ip))
        })
        .collect();
    addresses.sort_by_key(|(not_primary, _)| *not_primary);
    Member {
        name: interface.name_any(),
        network: interface.spec.network.name.clone(),
        location: interface
            .labels()
            .get(LOCATION_LABEL)
            .filter(|l| !l.is_empty())
            .cloned(),
        healthy: is_healthy(interface),
        addresses: addresses.into_iter().map(|(_, ip)| ip).collect(),
    }
}

/// Resolves a selector over the interfaces of the service's namespace.
pub fn resolve<'a>(
    selector: Result<Selector, String>,
    interfaces: impl IntoIterator<Item = &'a NetworkInterface>,
) -> Resolution {
    let selector = match selector {
        Ok(s) => s,
        Err(e) => return Resolution::InvalidSelector(e),
    };
    let mut members: Vec<Member> = interfaces
        .into_iter()
        .filter(|i| is_bound(i) && selector.matches(i.labels()))
        .map(member)
        .collect();
    if members.is_empty() {
        return Resolution::NoMatch;
    }
    members.sort_by(|a, b| a.name.cmp(&b.name));
    let mut networks: Vec<String> = members.iter().map(|m| m.network.clone()).collect();
    networks.sort();
    networks.dedup();
    if networks.len() > 1 {
        return Resolution::MultipleNetworks(networks);
    }
    Resolution::Resolved(members)
}

fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    previous: Option<&NetworkServiceStatus>,
    now: &Time,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let last = previous
        .and_then(|p| p.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status)
        .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: last,
    }
}

/// The status for `resolution` of a service at `generation`, keeping `previous` transition
/// times of conditions whose status did not change, so that an unchanged world yields a status
/// equal to `previous` (no write).
pub fn status(
    generation: Option<i64>,
    resolution: &Resolution,
    previous: Option<&NetworkServiceStatus>,
    now: Timestamp,
) -> NetworkServiceStatus {
    let now = Time(now);
    let (resolved_ok, reason, message, summary, locations) = match resolution {
        Resolution::InvalidSelector(e) => (
            false,
            reasons::INVALID_SELECTOR,
            format!("selector is invalid: {e}"),
            None,
            None,
        ),
        Resolution::NoMatch => (
            false,
            reasons::NO_MATCHING_INTERFACES,
            "no Bound NetworkInterface in this namespace matches the selector".to_owned(),
            None,
            None,
        ),
        Resolution::MultipleNetworks(networks) => (
            false,
            reasons::MULTIPLE_NETWORKS,
            format!("members span more than one network: {}", networks.join(", ")),
            None,
            None,
        ),
        Resolution::Resolved(members) => {
            let (summary, locations, message) = rollup(members);
            (true, reasons::RESOLVED, message, Some(summary), Some(locations))
        }
    };
    let serving = locations
        .as_ref()
        .is_some_and(|l: &Vec<LocationStatus>| l.iter().any(|l| l.serving));
    let resolved = condition(
        MEMBERS_RESOLVED,
        resolved_ok,
        reason,
        message.clone(),
        generation,
        previous,
        &now,
    );
    let ready = if !resolved_ok {
        condition(READY, false, reason, message, generation, previous, &now)
    } else if !serving {
        condition(
            READY,
            false,
            reasons::NO_SERVING_LOCATIONS,
            "no location has a healthy member".to_owned(),
            generation,
            previous,
            &now,
        )
    } else {
        condition(
            READY,
            true,
            reasons::READY,
            "at least one location serves".to_owned(),
            generation,
            previous,
            &now,
        )
    };
    NetworkServiceStatus {
        observed_generation: generation,
        summary,
        locations,
        conditions: Some(vec![resolved, ready]),
    }
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Per-location rollup of resolved members: summary, listed locations and the message.
fn rollup(members: &[Member]) -> (ServiceSummary, Vec<LocationStatus>, String) {
    let mut by_location: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let mut unlocated: Vec<&str> = Vec::new();
    for m in members {
        match &m.location {
            Some(location) => {
                let entry = by_location.entry(location).or_default();
                entry.0 += 1;
                entry.1 += usize::from(m.healthy);
            }
            None => unlocated.push(&m.name),
        }
    }
    let healthy: usize = by_location.values().map(|(_, h)| h).sum();
    let summary = ServiceSummary {
        locations: count(by_location.len()),
        members: count(members.len()),
        healthy: count(healthy),
    };
    let locations: Vec<LocationStatus> = by_location
        .iter()
        .take(MAX_LOCATIONS)
        .map(|(name, (members, healthy))| LocationStatus {
            name: (*name).to_owned(),
            members: count(*members),
            healthy: count(*healthy),
            serving: *healthy > 0,
        })
        .collect();
    let mut message = format!(
        "{} interfaces matched across {} locations",
        members.len(),
        by_location.len()
    );
    if !unlocated.is_empty() {
        message.push_str(&format!(
            "; {} without a {LOCATION_LABEL} label (counted, never healthy): {}",
            unlocated.len(),
            unlocated.join(", ")
        ));
    }
    if by_location.len() > MAX_LOCATIONS {
        message.push_str(&format!("; only the first {MAX_LOCATIONS} locations are listed"));
    }
    (summary, locations, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{InterfaceAddress, IpFamily, LocalObjectReference, NetworkInterfaceSpec, NetworkInterfaceStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn ni(name: &str, network: &str, location: Option<&str>, phase: &str, healthy: Option<bool>) -> NetworkInterface {
        let mut labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        if let Some(l) = location {
            labels.insert(LOCATION_LABEL.to_owned(), l.to_owned());
        }
        let mut ni = NetworkInterface::new(
            name,
            NetworkInterfaceSpec {
                network: LocalObjectReference { name: network.into() },
                addresses: Some(vec![InterfaceAddress {
                    family: IpFamily::IPv6,
                    address: "fd00::1/64".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
        );
        ni.metadata.labels = Some(labels);
        ni.metadata.namespace = Some("ns".into());
        ni.status = Some(NetworkInterfaceStatus {
            phase: Some(phase.into()),
            conditions: healthy.map(|h| {
                vec![Condition {
                    type_: HOLDER_AVAILABLE.into(),
                    status: if h { "True" } else { "False" }.into(),
                    reason: "r".into(),
                    message: String::new(),
                    observed_generation: None,
                    last_transition_time: Time(Timestamp::UNIX_EPOCH),
                }]
            }),
            ..Default::default()
        });
        ni
    }

    fn web() -> Result<Selector, String> {
        Selector::try_from(LabelSelector {
            match_labels: Some(BTreeMap::from([("app".to_owned(), "web".to_owned())])),
            match_expressions: None,
        })
        .map_err(|e| e.to_string())
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    fn cond<'a>(s: &'a NetworkServiceStatus, t: &str) -> &'a Condition {
        s.conditions.as_ref().unwrap().iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn two_locations_with_healthy_members_are_ready() {
        let nis = [
            ni("a1", "net", Some("dfw"), "Bound", Some(true)),
            ni("a2", "net", Some("dfw"), "Bound", Some(true)),
            ni("b1", "net", Some("sjc"), "Bound", Some(true)),
        ];
        let s = status(Some(3), &resolve(web(), &nis), None, at(100));
        assert_eq!(
            s.summary,
            Some(ServiceSummary {
                locations: 2,
                members: 3,
                healthy: 3
            })
        );
        let locs = s.locations.clone().unwrap();
        assert_eq!(
            locs,
            vec![
                LocationStatus {
                    name: "dfw".into(),
                    members: 2,
                    healthy: 2,
                    serving: true
                },
                LocationStatus {
                    name: "sjc".into(),
                    members: 1,
                    healthy: 1,
                    serving: true
                },
            ]
        );
        assert_eq!(cond(&s, MEMBERS_RESOLVED).reason, reasons::RESOLVED);
        assert_eq!(
            cond(&s, MEMBERS_RESOLVED).message,
            "3 interfaces matched across 2 locations"
        );
        assert_eq!(cond(&s, READY).status, "True");
        assert_eq!(cond(&s, READY).observed_generation, Some(3));
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn an_unhealthy_member_is_counted_but_not_healthy() {
        let nis = [
            ni("a1", "net", Some("dfw"), "Bound", Some(true)),
            ni("a2", "net", Some("dfw"), "Bound", Some(false)),
        ];
        let s = status(None, &resolve(web(), &nis), None, at(1));
        assert_eq!(
            s.summary,
            Some(ServiceSummary {
                locations: 1,
                members: 2,
                healthy: 1
            })
        );
    }

    #[test]
    fn zero_healthy_means_not_serving_and_not_ready() {
        let nis = [
            ni("a1", "net", Some("dfw"), "Bound", Some(false)),
            ni("b1", "net", Some("sjc"), "Bound", None),
        ];
        let s = status(None, &resolve(web(), &nis), None, at(1));
        assert!(s.locations.as_ref().unwrap().iter().all(|l| !l.serving));
        assert_eq!(cond(&s, MEMBERS_RESOLVED).status, "True");
        assert_eq!(cond(&s, READY).status, "False");
        assert_eq!(cond(&s, READY).reason, reasons::NO_SERVING_LOCATIONS);
    }

    #[test]
    fn only_bound_interfaces_are_members() {
        let nis = [ni("a1", "net", Some("dfw"), "Available", Some(true))];
        let r = resolve(web(), &nis);
        assert_eq!(r, Resolution::NoMatch);
        let s = status(None, &r, None, at(1));
        assert_eq!(cond(&s, MEMBERS_RESOLVED).reason, reasons::NO_MATCHING_INTERFACES);
        assert_eq!(
            cond(&s, READY).reason,
            reasons::NO_MATCHING_INTERFACES,
            "Ready copies the failure"
        );
        assert_eq!(cond(&s, READY).message, cond(&s, MEMBERS_RESOLVED).message);
        assert_eq!(s.summary, None);
        assert_eq!(s.locations, None);
    }

    #[test]
    fn unlocated_members_count_in_the_summary_only_and_are_named() {
        let nis = [
            ni("a1", "net", Some("dfw"), "Bound", Some(true)),
            ni("z9", "net", None, "Bound", Some(true)),
        ];
        let s = status(None, &resolve(web(), &nis), None, at(1));
        assert_eq!(
            s.summary,
            Some(ServiceSummary {
                locations: 1,
                members: 2,
                healthy: 1
            })
        );
        assert_eq!(s.locations.as_ref().unwrap().len(), 1);
        let msg = &cond(&s, MEMBERS_RESOLVED).message;
        assert!(msg.starts_with("2 interfaces matched across 1 locations"), "{msg}");
        assert!(msg.contains("z9"), "{msg}");
    }

    #[test]
    fn multiple_networks_names_both_and_leaves_lists_empty() {
        let nis = [
            ni("a1", "blue", Some("dfw"), "Bound", Some(true)),
            ni("b1", "green", Some("sjc"), "Bound", Some(true)),
        ];
        let r = resolve(web(), &nis);
        assert_eq!(r, Resolution::MultipleNetworks(vec!["blue".into(), "green".into()]));
        let s = status(None, &r, None, at(1));
        assert_eq!(cond(&s, MEMBERS_RESOLVED).reason, reasons::MULTIPLE_NETWORKS);
        assert_eq!(
            cond(&s, MEMBERS_RESOLVED).message,
            "members span more than one network: blue, green"
        );
        assert_eq!(cond(&s, READY).reason, reasons::MULTIPLE_NETWORKS);
        assert_eq!((s.summary, s.locations), (None, None));
    }

    #[test]
    fn more_than_64_locations_are_cut_and_noted() {
        let nis: Vec<_> = (0..70)
            .map(|i| {
                ni(
                    &format!("m{i:02}"),
                    "net",
                    Some(&format!("loc-{i:02}")),
                    "Bound",
                    Some(true),
                )
            })
            .collect();
        let s = status(None, &resolve(web(), &nis), None, at(1));
        assert_eq!(s.summary.as_ref().unwrap().locations, 70);
        let locs = s.locations.as_ref().unwrap();
        assert_eq!(locs.len(), 64);
        assert_eq!(locs[0].name, "loc-00");
        assert_eq!(locs[63].name, "loc-63");
        assert!(
            cond(&s, MEMBERS_RESOLVED)
                .message
                .ends_with("only the first 64 locations are listed")
        );
    }

    #[test]
    fn an_invalid_selector_is_reported() {
        let bad = Selector::try_from(LabelSelector {
            match_expressions: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "app".into(),
                    operator: "Near".into(),
                    values: None,
                },
            ]),
            match_labels: None,
        })
        .map_err(|e| e.to_string());
        let s = status(None, &resolve(bad, &[]), None, at(1));
        assert_eq!(cond(&s, MEMBERS_RESOLVED).reason, reasons::INVALID_SELECTOR);
        assert!(cond(&s, MEMBERS_RESOLVED).message.starts_with("selector is invalid: "));
        assert_eq!(cond(&s, READY).reason, reasons::INVALID_SELECTOR);
    }

    #[test]
    fn an_unchanged_world_yields_an_equal_status_and_transitions_keep_times() {
        let nis = [ni("a1", "net", Some("dfw"), "Bound", Some(true))];
        let first = status(Some(1), &resolve(web(), &nis), None, at(100));
        let again = status(Some(1), &resolve(web(), &nis), Some(&first), at(200));
        assert_eq!(first, again, "idempotent: no write when nothing changed");

        let sick = [ni("a1", "net", Some("dfw"), "Bound", Some(false))];
        let flipped = status(Some(1), &resolve(web(), &sick), Some(&first), at(300));
        assert_eq!(cond(&flipped, READY).last_transition_time, Time(at(300)));
        assert_eq!(
            cond(&flipped, MEMBERS_RESOLVED).last_transition_time,
            Time(at(100)),
            "status unchanged: time kept"
        );
    }

    #[test]
    fn member_addresses_are_bare_canonical_and_primary_first() {
        let mut i = ni("a1", "net", Some("dfw"), "Bound", Some(true));
        i.spec.addresses = Some(vec![
            InterfaceAddress {
                family: IpFamily::IPv4,
                address: "10.0.0.5/24".into(),
                ..Default::default()
            },
            InterfaceAddress {
                family: IpFamily::IPv6,
                address: "FD00:0:0:0::0A/64".into(),
                primary: Some(true),
                ..Default::default()
            },
        ]);
        i.spec.external_addresses = Some(vec![crate::api::ExternalAddress {
            family: IpFamily::IPv4,
            address: "203.0.113.1".into(),
            class: None,
        }]);
        let m = member(&i);
        assert_eq!(
            m.addresses,
            vec!["fd00::a".parse::<IpAddr>().unwrap(), "10.0.0.5".parse().unwrap()]
        );
        assert_eq!(m.addresses[0].to_string(), "fd00::a");
    }

    #[test]
    fn slices_condition_and_its_effect_on_ready() {
        let healthy = [ni("a1", "net", Some("dfw"), "Bound", Some(true))];
        let r = resolve(web(), &healthy);
        let conflict = SlicesOutcome::Conflicts(vec!["EndpointSlice api-http belongs to NetworkService a".into()]);
        // (case, outcome, SlicesPublished (status, reason, message), Ready (status, reason))
        type Case<'a> = (&'a str, SlicesOutcome, (&'a str, &'a str, &'a str), (&'a str, &'a str));
        let cases: Vec<Case<'_>> = vec![
            (
                "published",
                SlicesOutcome::Published,
                ("True", reasons::PUBLISHED, "every EndpointSlice is in place"),
                ("True", reasons::READY),
            ),
            (
                "conflict",
                conflict.clone(),
                (
                    "False",
                    reasons::SLICE_NAME_CONFLICT,
                    "not overwritten: EndpointSlice api-http belongs to NetworkService a",
                ),
                ("False", reasons::SLICE_NAME_CONFLICT),
            ),
            (
                "rejected",
                SlicesOutcome::Rejected(vec!["EndpointSlice api-http: invalid (422)".into()]),
                (
                    "False",
                    reasons::SLICE_REJECTED,
                    "EndpointSlice api-http: invalid (422)",
                ),
                ("False", reasons::SLICE_REJECTED),
            ),
            (
                "invalid name",
                SlicesOutcome::InvalidName("bad name".into()),
                ("False", reasons::INVALID_SERVICE_NAME, "bad name"),
                ("False", reasons::INVALID_SERVICE_NAME),
            ),
            (
                "pending, nothing before",
                SlicesOutcome::Pending("timed out".into()),
                ("False", reasons::PENDING, "EndpointSlices not written yet: timed out"),
                ("False", reasons::PENDING),
            ),
        ];
        for (what, outcome, (status_, reason, message), (ready_status, ready_reason)) in cases {
            let s = with_slices(status(Some(2), &r, None, at(1)), &outcome, Some(2), None, at(1));
            let types: Vec<&str> = s.conditions.iter().flatten().map(|c| c.type_.as_str()).collect();
            assert_eq!(types, [MEMBERS_RESOLVED, READY, SLICES_PUBLISHED], "{what}");
            let c = cond(&s, SLICES_PUBLISHED);
            assert_eq!(
                (
                    c.status.as_str(),
                    c.reason.as_str(),
                    c.message.as_str(),
                    c.observed_generation
                ),
                (status_, reason, message, Some(2)),
                "{what}"
            );
            let ready = cond(&s, READY);
            assert_eq!(
                (ready.status.as_str(), ready.reason.as_str()),
                (ready_status, ready_reason),
                "{what}"
            );
        }

        // A MembersResolved failure stays what Ready says; the slices condition stands beside it.
        let s = with_slices(
            status(None, &resolve(web(), &[]), None, at(1)),
            &conflict,
            None,
            None,
            at(1),
        );
        assert_eq!(cond(&s, READY).reason, reasons::NO_MATCHING_INTERFACES);
        assert_eq!(cond(&s, SLICES_PUBLISHED).reason, reasons::SLICE_NAME_CONFLICT);

        // Pending keeps the previous condition, its time included; a later equal pass is equal.
        let first = with_slices(
            status(Some(1), &r, None, at(100)),
            &SlicesOutcome::Published,
            Some(1),
            None,
            at(100),
        );
        let pending = with_slices(
            status(Some(1), &r, Some(&first), at(200)),
            &SlicesOutcome::Pending("timed out".into()),
            Some(1),
            Some(&first),
            at(200),
        );
        assert_eq!(pending, first, "a hub hiccup writes no status");
        let conflicted = with_slices(
            status(Some(1), &r, Some(&first), at(300)),
            &conflict,
            Some(1),
            Some(&first),
            at(300),
        );
        assert_eq!(cond(&conflicted, SLICES_PUBLISHED).last_transition_time, Time(at(300)));
        let again = with_slices(
            status(Some(1), &r, Some(&conflicted), at(400)),
            &conflict,
            Some(1),
            Some(&conflicted),
            at(400),
        );
        assert_eq!(again, conflicted, "an unchanged conflict writes no status");

        // Many conflicts: five named, the rest counted.
        let many = SlicesOutcome::Conflicts((0..7).map(|i| format!("s{i}")).collect());
        let s = with_slices(status(None, &r, None, at(1)), &many, None, None, at(1));
        assert_eq!(
            cond(&s, SLICES_PUBLISHED).message,
            "not overwritten: s0; s1; s2; s3; s4; and 2 more"
        );
    }
}
