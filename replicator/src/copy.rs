//! Source object → desired hub copy. Pure: no I/O, no clock (docs/architecture.md).
//!
//! [`plan`] turns a cell object, its rule, the publishing location and the namespace's routing
//! into a [`Plan`]: publish a [`Desired`] copy, hold, withdraw, or ignore. [`copy_name`] is the
//! location-suffixed, length-safe copy name; [`in_sync`] judges drift on the fields the
//! replicator owns. The copy is built from the source's raw JSON, so fields this code does not
//! know cross intact (a cell on a newer CRD version loses nothing on the way).

use std::collections::BTreeMap;

use kube::{
    api::DynamicObject,
    core::{Selector, SelectorExt},
};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::{
    routing::Routing,
    rules::{self, FieldPath, Hold, LabelValueSource, Rule},
};

/// Annotation on every copy: the source's namespace.
pub const SOURCE_NAMESPACE_ANNOTATION: &str = "replicator.datumapis.com/source-namespace";
/// Annotation on every copy: the source's name (names may exceed label-value limits).
pub const SOURCE_NAME_ANNOTATION: &str = "replicator.datumapis.com/source-name";
/// Annotation on every copy: the source's UID.
pub const SOURCE_UID_ANNOTATION: &str = "replicator.datumapis.com/source-uid";
/// Annotation on every copy: the cell that published it, as the UID of that cell's
/// `kube-system` namespace (the conventional cluster ID). A replicator never modifies, repairs or
/// sweeps a copy another cell published, even under its own location (see [`publishing_cell`]).
pub const CELL_ANNOTATION: &str = "replicator.datumapis.com/cell";
/// Annotation on every copy: hash of the desired content; a write that would change nothing is
/// skipped.
pub const CONTENT_HASH_ANNOTATION: &str = "replicator.datumapis.com/content-hash";
/// Longest copy name: the DNS-subdomain limit (253) less 32 characters for the suffix Karmada
/// appends to name a copy's ResourceBinding (`<copy>-<kind, lowercased>`, which must fit 253
/// too: a 244-character EndpointSlice copy was refused propagation with "must be no more than
/// 253 characters"). Covers kinds of up to 31 characters.
pub const MAX_NAME_LEN: usize = 253 - 32;
/// Hex digits of the name hash inserted into shortened copy names.
const NAME_HASH_LEN: usize = 16;

/// Why no plan could be made for a source. The copy already published stays as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The source has no name or no namespace (every mirrored kind is namespaced).
    #[error("source has no {0}")]
    MissingIdentity(&'static str),
    /// An added label's value is not a valid label value (e.g. a claim name over 63 characters).
    #[error("label {key} would get invalid value {value:?} (at most 63 of [A-Za-z0-9._-], alphanumeric ends)")]
    InvalidLabelValue {
        /// The label key.
        key: String,
        /// The rejected value.
        value: String,
    },
}

/// What to do with one source key.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Make the hub copy equal to this.
    Publish(Box<Desired>),
    /// Publish nothing and withdraw nothing (the rule's hold holds, e.g. zero endpoints).
    Hold,
    /// The object is no longer a source (it left the rule's selector): withdraw our copy.
    Withdraw,
    /// The object is itself a copy (ours or Karmada's): never mirrored, nothing withdrawn.
    Ignore,
}

/// The desired hub copy of one source.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    /// Copy name, `<source name>-<location>` (see [`copy_name`]).
    pub name: String,
    /// Copy namespace: the source's namespace name.
    pub namespace: String,
    /// The server-side apply body: `apiVersion`, `kind`, `metadata` (name, namespace, labels,
    /// annotations) and every carried top-level field.
    pub object: Value,
    /// The status apply body (`apiVersion`, `kind`, `metadata.name/namespace`, `status`) when the
    /// rule carries status; `None` for spec-only kinds, whose copy status is never written.
    pub status: Option<Value>,
    /// The status paths the rule carries (empty for spec-only kinds): the part of the copy's
    /// status this replica owns, present in `status` or, when the source has none there, to be
    /// cleared on the copy ([`status_in_sync`]).
    pub status_paths: Vec<FieldPath>,
    /// Hex SHA-256 (first 32 digits) of everything above, stored in [`CONTENT_HASH_ANNOTATION`].
    pub hash: String,
}

/// The copy name for source `namespace/name` published by `location` (docs/architecture.md).
///
/// `<name>-<location>` when that fits in [`MAX_NAME_LEN`] (221) characters; otherwise the source part is cut and a
/// 16-hex-digit SHA-256 of `location/namespace/name` is inserted: `<cut>-<hash>-<location>`.
/// Depends only on immutable identity, never on labels. `location` is a DNS label (≤ 63).
pub fn copy_name(namespace: &str, name: &str, location: &str) -> String {
    let suffix_len = location.len() + 1;
    if name.len() + suffix_len <= MAX_NAME_LEN {
        return format!("{name}-{location}");
    }
    let digest = Sha256::digest(format!("{location}/{namespace}/{name}").as_bytes());
    let hash = hex(&digest[..NAME_HASH_LEN / 2]);
    let keep = MAX_NAME_LEN.saturating_sub(suffix_len + 1 + NAME_HASH_LEN);
    let mut end = keep.min(name.len());
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let head = name[..end].trim_end_matches(['-', '.']);
    format!("{head}-{hash}-{location}")
}

/// Plans the copy of `source` under `rule`, published by `location` with `routing`.
///
/// Order of rules: a copy (carrying `replicator.datumapis.com/location` or `karmada.io/managed`)
/// is ignored; an object outside the rule's selector is withdrawn; a held object (e.g. a slice
/// with zero endpoints, seed 003) is held; everything else is published.
///
/// # Errors
/// [`Error`] when the source lacks identity or an added label would be invalid; the caller
/// reports it and leaves the published copy alone.
pub fn plan(rule: &Rule, location: &str, source: &DynamicObject, routing: &Routing) -> Result<Plan, Error> {
    let meta = &source.metadata;
    let name = meta.name.as_deref().ok_or(Error::MissingIdentity("name"))?;
    let namespace = meta.namespace.as_deref().ok_or(Error::MissingIdentity("namespace"))?;
    let empty = BTreeMap::new();
    let source_labels = meta.labels.as_ref().unwrap_or(&empty);
    if is_copy(source_labels) {
        return Ok(Plan::Ignore);
    }
    if let Some(selector) = &rule.source_selector {
        // A selector that fails to parse was rejected by rule validation at start-up.
        let matches = Selector::try_from(selector.clone()).is_ok_and(|s| s.matches(source_labels));
        if !matches {
            return Ok(Plan::Withdraw);
        }
    }
    if let Some(Hold::EmptyList(path)) = &rule.hold {
        let held = match lookup(&source.data, path.segments()) {
            None | Some(Value::Null) => true,
            Some(Value::Array(items)) => items.is_empty(),
            Some(_) => false,
        };
        if held {
            return Ok(Plan::Hold);
        }
    }

    let mut labels: BTreeMap<String, String> = source_labels
        .iter()
        .filter(|(k, _)| rule.labels.allows(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for added in &rule.labels_added {
        let value = match &added.from {
            LabelValueSource::SourceNamespace => Some(namespace.to_owned()),
            LabelValueSource::Field(path) => lookup(&source.data, path.segments())
                .and_then(Value::as_str)
                .map(str::to_owned),
        };
        match value {
            Some(value) if rules::is_label_value(&value) => {
                labels.insert(added.key.clone(), value);
            }
            Some(value) => {
                return Err(Error::InvalidLabelValue {
                    key: added.key.clone(),
                    value,
                });
            }
            None => {
                labels.remove(&added.key);
            }
        }
    }
    for (key, value) in routing.labels() {
        labels.insert(key.to_owned(), value.to_owned());
    }
    labels.insert(rules::LOCATION_LABEL.to_owned(), location.to_owned());

    let mut annotations: BTreeMap<String, String> = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| rule.annotations.allows(k) && !k.starts_with("replicator.datumapis.com/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.insert(SOURCE_NAMESPACE_ANNOTATION.to_owned(), namespace.to_owned());
    annotations.insert(SOURCE_NAME_ANNOTATION.to_owned(), name.to_owned());
    if let Some(uid) = &meta.uid {
        annotations.insert(SOURCE_UID_ANNOTATION.to_owned(), uid.clone());
    }

    let mut fields = match &source.data {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    fields.remove("status");
    fields.remove("metadata");
    fields.remove("apiVersion");
    fields.remove("kind");
    let mut fields = Value::Object(fields);
    for path in &rule.fields_dropped {
        remove(&mut fields, path.segments());
    }

    let status = (!rule.status.is_empty()).then(|| {
        let mut carried = Map::new();
        if let Some(source_status) = source.data.get("status") {
            for path in &rule.status {
                if let Some(value) = lookup(source_status, path.segments()) {
                    insert(&mut carried, path.segments(), value.clone());
                }
            }
        }
        Value::Object(carried)
    });

    let copy_name = copy_name(namespace, name, location);
    let hash = content_hash(&labels, &annotations, &fields, status.as_ref());
    annotations.insert(CONTENT_HASH_ANNOTATION.to_owned(), hash.clone());

    let api_version = rule.resource.api_version();
    let mut object = json!({
        "apiVersion": api_version,
        "kind": rule.resource.kind,
        "metadata": {
            "name": copy_name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
    });
    if let (Value::Object(target), Value::Object(carried)) = (&mut object, fields) {
        target.extend(carried);
    }
    let status = status.map(|status| {
        json!({
            "apiVersion": api_version,
            "kind": rule.resource.kind,
            "metadata": {"name": copy_name, "namespace": namespace},
            "status": status,
        })
    });
    Ok(Plan::Publish(Box::new(Desired {
        name: copy_name,
        namespace: namespace.to_owned(),
        object,
        status,
        status_paths: rule.status.clone(),
        hash,
    })))
}

/// Whether an object with these labels is a copy (ours or delivered by Karmada): never a source.
pub fn is_copy(labels: &BTreeMap<String, String>) -> bool {
    labels.contains_key(rules::LOCATION_LABEL) || labels.contains_key(rules::KARMADA_MANAGED_LABEL)
}

/// Whether `copy` was published by `location`: the only copies the replicator of `location` may
/// modify or delete (docs/architecture.md). `copy` is a whole object or its metadata alone.
pub fn published_by(copy: &impl kube::Resource, location: &str) -> bool {
    copy.meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(rules::LOCATION_LABEL))
        .is_some_and(|l| l == location)
}

/// The cell that published `copy` ([`CELL_ANNOTATION`]); `None` for a copy written before cells
/// were recorded (the next write of its location's replicator records its cell).
pub fn publishing_cell(copy: &impl kube::Resource) -> Option<&str> {
    copy.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(CELL_ANNOTATION))
        .map(String::as_str)
}

/// Whether `copy` is the copy of `location` published by `cell`: the location label is
/// `location` and the recorded cell is `cell` or none yet. Every write, withdrawal and sweep of
/// a replicator is limited to these.
pub fn published_by_cell(copy: &impl kube::Resource, location: &str, cell: &str) -> bool {
    published_by(copy, location) && publishing_cell(copy).is_none_or(|c| c == cell)
}

/// Records `cell` as the publisher of `desired` ([`CELL_ANNOTATION`]). Not part of the content
/// hash: [`in_sync`] still sees a copy without it, or with another cell, as out of sync.
pub fn mark_cell(desired: &mut Desired, cell: &str) {
    if let Some(annotations) = desired
        .object
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        annotations.insert(CELL_ANNOTATION.to_owned(), Value::String(cell.to_owned()));
    }
}

/// Whether the hub copy already carries everything `desired` owns: content hash, every desired
/// label, annotation and field (object subset, arrays element-wise) and, for kinds with status,
/// the carried status. Fields others own (Karmada's labels, defaults) are ignored.
pub fn in_sync(desired: &Desired, copy: &DynamicObject) -> bool {
    let hash_matches = copy
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CONTENT_HASH_ANNOTATION))
        == Some(&desired.hash);
    if !hash_matches {
        return false;
    }
    let Ok(actual) = serde_json::to_value(copy) else {
        return false;
    };
    // Items of a LIST of built-in kinds carry no apiVersion/kind; identity is the cache's.
    let owned = |body: &Value| match body {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| k.as_str() != "apiVersion" && k.as_str() != "kind")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        other => other.clone(),
    };
    contains(&actual, &owned(&desired.object)) && status_in_sync(desired, Some(copy))
}

/// Whether the hub copy (`None`: no copy yet, a create) already carries the status `desired`
/// owns, so that no status write is needed. True for kinds whose status is not carried. Else,
/// for every carried status path: the copy's value contains the desired one (see [`contains`];
/// values others add, say defaults, are ignored), and a path the source does not have is absent
/// on the copy too (a status field gone from the source is cleared on the copy). So a source
/// with nothing at the carried paths needs no status write on create: the status subresource
/// write would be an empty apply, a hub round trip for nothing (issue #5).
pub fn status_in_sync(desired: &Desired, copy: Option<&DynamicObject>) -> bool {
    let Some(body) = &desired.status else {
        return true;
    };
    let wanted = body.get("status");
    let actual = copy.and_then(|c| c.data.get("status"));
    desired.status_paths.iter().all(|path| {
        let want = wanted.and_then(|w| lookup(w, path.segments())).filter(|v| !v.is_null());
        let have = actual.and_then(|a| lookup(a, path.segments())).filter(|v| !v.is_null());
        match (want, have) {
            (None, None) => true,
            (Some(want), Some(have)) => contains(have, want),
            _ => false,
        }
    })
}

/// Whether `actual` contains `desired`: objects by key (recursively), arrays element-wise with
/// equal length, scalars by equality; a desired `null` also accepts an absent key.
pub fn contains(actual: &Value, desired: &Value) -> bool {
    match (desired, actual) {
        (Value::Object(d), Value::Object(a)) => d.iter().all(|(k, dv)| match a.get(k) {
            Some(av) => contains(av, dv),
            None => dv.is_null(),
        }),
        (Value::Array(d), Value::Array(a)) => d.len() == a.len() && d.iter().zip(a).all(|(dv, av)| contains(av, dv)),
        _ => desired == actual,
    }
}

fn content_hash(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    fields: &Value,
    status: Option<&Value>,
) -> String {
    // serde_json maps are BTreeMaps here (no preserve_order), so serialization is canonical.
    let canonical = json!({"labels": labels, "annotations": annotations, "fields": fields, "status": status});
    let digest = Sha256::digest(canonical.to_string().as_bytes());
    hex(&digest[..16])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn lookup<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, segment| v.get(segment))
}

fn remove(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = value;
    for segment in parents {
        match current.get_mut(segment) {
            Some(next) => current = next,
            None => return,
        }
    }
    if let Value::Object(map) = current {
        map.remove(last);
    }
}

fn insert(map: &mut Map<String, Value>, path: &[String], value: Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = map;
    for segment in parents {
        let entry = current
            .entry(segment.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if !entry.is_object() {
            *entry = Value::Object(Map::new());
        }
        let Value::Object(next) = entry else { return };
        current = next;
    }
    current.insert(last.clone(), value);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::default_rules;

    fn rule(name: &str) -> Rule {
        default_rules().into_iter().find(|r| r.name == name).unwrap()
    }

    fn routing() -> Routing {
        Routing {
            upstream_cluster_name: "cluster-acme_web".into(),
            upstream_namespace: "default".into(),
        }
    }

    fn obj(v: Value) -> DynamicObject {
        serde_json::from_value(v).unwrap()
    }

    fn publish(rule_name: &str, source: Value) -> Desired {
        match plan(&rule(rule_name), "dfw", &obj(source), &routing()).unwrap() {
            Plan::Publish(d) => *d,
            other => panic!("expected publish, got {other:?}"),
        }
    }

    fn interface() -> Value {
        json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "NetworkInterface",
            "metadata": {
                "name": "web-0-eth0", "namespace": "ns-1", "uid": "u-1", "resourceVersion": "7",
                "labels": {
                    "compute.datumapis.com/workload": "web",
                    "networking.datumapis.com/location": "dfw",
                    "networking.datumapis.com/network": "default",
                    "app": "x"
                },
                "annotations": {"note": "cell only"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pu"}],
                "managedFields": [{"manager": "m"}]
            },
            "spec": {
                "network": {"name": "default"},
                "claimRef": {"name": "web-0"},
                "attachmentMode": "Netns",
                "interfaceName": "eth0",
                "addresses": [{"family": "IPv6", "address": "fd00::1/64", "primary": true}],
                "futureField": {"kept": true}
            },
            "status": {
                "phase": "Bound",
                "vpc": "v-1",
                "networkContextRef": {"name": "default-dfw"},
                "conditions": [{"type": "HolderAvailable", "status": "True", "reason": "HolderAvailable",
                                "message": "", "lastTransitionTime": "2026-11-29T00:00:00Z"}]
            }
        })
    }

    fn slice(endpoints: Value) -> Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "pod-abc", "namespace": "ns-1", "uid": "u-2",
                "labels": {"galactic.datum.net/tenant-id": "vpc1-att1", "x": "y"},
                "annotations": {"galactic.datum.net/srv6-sid": "fc00:0:1:e000::", "galactic.datum.net/tenant-id": "vpc1-att1"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "pod-abc", "uid": "pu"}]
            },
            "addressType": "IPv6",
            "endpoints": endpoints
        })
    }

    #[test]
    fn the_publishing_cell_is_recorded_and_bounds_what_a_replicator_touches() {
        let mut d = publish("endpointslices", slice(json!([{"addresses": ["fd00::1"]}])));
        let hash = d.hash.clone();
        mark_cell(&mut d, "uid-cell-1");
        assert_eq!(d.object["metadata"]["annotations"][CELL_ANNOTATION], "uid-cell-1");
        assert_eq!(d.hash, hash, "the mark is not content");

        let copy = |labels: Value, annotations: Value| {
            obj(json!({"apiVersion": "v1", "kind": "X",
                "metadata": {"name": "c", "namespace": "n", "labels": labels, "annotations": annotations}}))
        };
        let ours = copy(
            json!({"replicator.datumapis.com/location": "dfw"}),
            json!({CELL_ANNOTATION: "uid-cell-1"}),
        );
        let other_cell = copy(
            json!({"replicator.datumapis.com/location": "dfw"}),
            json!({CELL_ANNOTATION: "uid-cell-2"}),
        );
        let unrecorded = copy(json!({"replicator.datumapis.com/location": "dfw"}), json!({}));
        let other_location = copy(
            json!({"replicator.datumapis.com/location": "iad"}),
            json!({CELL_ANNOTATION: "uid-cell-1"}),
        );
        let hand_made = copy(json!({}), json!({CELL_ANNOTATION: "uid-cell-1"}));
        assert_eq!(publishing_cell(&ours), Some("uid-cell-1"));
        assert_eq!(publishing_cell(&unrecorded), None);
        assert!(published_by_cell(&ours, "dfw", "uid-cell-1"));
        assert!(!published_by_cell(&other_cell, "dfw", "uid-cell-1"));
        assert!(
            published_by_cell(&unrecorded, "dfw", "uid-cell-1"),
            "adopted on its next write"
        );
        assert!(!published_by_cell(&other_location, "dfw", "uid-cell-1"));
        assert!(!published_by_cell(&hand_made, "dfw", "uid-cell-1"));

        // A copy without the mark, or with another cell's, is out of sync: the next pass writes it.
        let mut written = json!(d.object.clone());
        written["metadata"]["annotations"][CELL_ANNOTATION] = json!("uid-cell-2");
        assert!(!in_sync(&d, &obj(written.clone())));
        written["metadata"]["annotations"][CELL_ANNOTATION] = json!("uid-cell-1");
        assert!(in_sync(&d, &obj(written)));
    }

    #[test]
    fn interface_copy_drops_cell_fields_and_keeps_phase_and_conditions() {
        let d = publish("networkinterfaces", interface());
        assert_eq!(d.name, "web-0-eth0-dfw");
        assert_eq!(d.namespace, "ns-1");
        let spec = &d.object["spec"];
        assert!(spec.get("claimRef").is_none());
        assert!(spec.get("attachmentMode").is_none());
        assert_eq!(spec["futureField"], json!({"kept": true}));
        assert_eq!(spec["addresses"][0]["address"], "fd00::1/64");
        let status = &d.status.as_ref().unwrap()["status"];
        assert_eq!(status["phase"], "Bound");
        assert_eq!(status["conditions"][0]["type"], "HolderAvailable");
        assert!(status.get("vpc").is_none());
        assert!(status.get("networkContextRef").is_none());
        assert!(d.object.get("status").is_none());
        let meta = &d.object["metadata"];
        assert!(meta.get("ownerReferences").is_none());
        assert!(meta.get("managedFields").is_none());
        assert!(meta.get("resourceVersion").is_none());
        assert!(meta.get("uid").is_none());
    }

    #[test]
    fn interface_labels_are_the_allow_list_plus_added_routing_and_location() {
        let d = publish("networkinterfaces", interface());
        let labels: BTreeMap<String, String> = serde_json::from_value(d.object["metadata"]["labels"].clone()).unwrap();
        let expected: BTreeMap<String, String> = [
            ("compute.datumapis.com/workload", "web"),
            ("networking.datumapis.com/location", "dfw"),
            ("networking.datumapis.com/held-by", "web-0"),
            ("networking.datumapis.com/source-namespace", "ns-1"),
            ("meta.datumapis.com/upstream-cluster-name", "cluster-acme_web"),
            ("meta.datumapis.com/upstream-namespace", "default"),
            ("replicator.datumapis.com/location", "dfw"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(labels, expected);
        let annotations = &d.object["metadata"]["annotations"];
        assert!(annotations.get("note").is_none());
        assert_eq!(annotations[SOURCE_NAME_ANNOTATION], "web-0-eth0");
        assert_eq!(annotations[SOURCE_NAMESPACE_ANNOTATION], "ns-1");
        assert_eq!(annotations[SOURCE_UID_ANNOTATION], "u-1");
        assert_eq!(annotations[CONTENT_HASH_ANNOTATION], d.hash.as_str());
    }

    #[test]
    fn a_dropped_source_label_changes_the_hash_and_leaves_the_desired_labels() {
        let before = publish("networkinterfaces", interface());
        let mut source = interface();
        source["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("compute.datumapis.com/workload");
        let after = publish("networkinterfaces", source);
        assert_ne!(before.hash, after.hash);
        assert!(
            after.object["metadata"]["labels"]
                .get("compute.datumapis.com/workload")
                .is_none()
        );
    }

    #[test]
    fn held_by_is_absent_without_a_claim_and_an_invalid_claim_name_is_an_error() {
        let mut source = interface();
        source["spec"].as_object_mut().unwrap().remove("claimRef");
        let d = publish("networkinterfaces", source);
        assert!(
            d.object["metadata"]["labels"]
                .get("networking.datumapis.com/held-by")
                .is_none()
        );

        let mut source = interface();
        source["spec"]["claimRef"]["name"] = json!("c".repeat(70));
        let err = plan(&rule("networkinterfaces"), "dfw", &obj(source), &routing()).unwrap_err();
        assert_eq!(
            err,
            Error::InvalidLabelValue {
                key: "networking.datumapis.com/held-by".into(),
                value: "c".repeat(70)
            }
        );
    }

    #[test]
    fn the_hash_is_stable_and_ignores_server_fields() {
        let a = publish("networkinterfaces", interface());
        let mut source = interface();
        source["metadata"]["resourceVersion"] = json!("99");
        source["metadata"]["managedFields"] = json!([]);
        let b = publish("networkinterfaces", source);
        assert_eq!(a, b);
    }

    #[test]
    fn network_context_carries_location_and_network_labels_only_and_never_status() {
        let d = publish(
            "networkcontexts",
            json!({
                "apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkContext",
                "metadata": {"name": "default-dfw", "namespace": "ns-1",
                             "labels": {"networking.datumapis.com/location": "dfw", "networking.datumapis.com/network": "default", "other": "no"}},
                "spec": {"network": {"name": "default"}, "location": {"name": "dfw"}},
                "status": {"conditions": []}
            }),
        );
        let labels = d.object["metadata"]["labels"].as_object().unwrap();
        assert_eq!(labels["networking.datumapis.com/location"], "dfw");
        assert_eq!(labels["networking.datumapis.com/network"], "default");
        assert!(labels.get("other").is_none());
        assert!(d.status.is_none());
        assert!(d.object.get("status").is_none());
    }

    #[test]
    fn galactic_slice_crosses_verbatim_without_owner_references() {
        let endpoints = json!([
            {"addresses": ["fd00::5"], "conditions": {"ready": true}, "targetRef": {"kind": "Pod", "name": "pod-abc"}},
            {"addresses": ["fd00::6"], "conditions": {}}
        ]);
        let d = publish("endpointslices", slice(endpoints.clone()));
        assert_eq!(d.name, "pod-abc-dfw");
        assert_eq!(d.object["endpoints"], endpoints);
        assert_eq!(d.object["addressType"], "IPv6");
        assert!(d.object.get("ports").is_none(), "nil ports stay nil");
        assert_eq!(
            d.object["metadata"]["annotations"]["galactic.datum.net/srv6-sid"],
            "fc00:0:1:e000::"
        );
        assert_eq!(d.object["metadata"]["labels"]["x"], "y");
        assert!(d.object["metadata"].get("ownerReferences").is_none());
        assert!(d.status.is_none());
    }

    #[test]
    fn a_slice_with_zero_endpoints_is_held() {
        let r = rule("endpointslices");
        assert_eq!(plan(&r, "dfw", &obj(slice(json!([]))), &routing()).unwrap(), Plan::Hold);
        let mut s = slice(json!([]));
        s.as_object_mut().unwrap().remove("endpoints");
        assert_eq!(plan(&r, "dfw", &obj(s), &routing()).unwrap(), Plan::Hold);
    }

    #[test]
    fn a_slice_without_the_tenant_label_is_withdrawn() {
        let mut s = slice(json!([{"addresses": ["fd00::5"]}]));
        s["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("galactic.datum.net/tenant-id");
        assert_eq!(
            plan(&rule("endpointslices"), "dfw", &obj(s), &routing()).unwrap(),
            Plan::Withdraw
        );
    }

    #[test]
    fn copies_are_never_sources() {
        for marker in ["replicator.datumapis.com/location", "karmada.io/managed"] {
            let mut s = slice(json!([{"addresses": ["fd00::5"]}]));
            s["metadata"]["labels"][marker] = json!("true");
            assert_eq!(
                plan(&rule("endpointslices"), "dfw", &obj(s), &routing()).unwrap(),
                Plan::Ignore
            );
        }
    }

    #[test]
    fn copy_names_are_suffixed_and_hashed_past_the_limit() {
        assert_eq!(copy_name("ns", "pod-a", "dfw"), "pod-a-dfw");
        let exact = "a".repeat(MAX_NAME_LEN - 4);
        assert_eq!(copy_name("ns", &exact, "dfw"), format!("{exact}-dfw"));
        let long = format!("{}-{}", "a".repeat(200), "b".repeat(48));
        let long = format!("{long}x");
        assert_eq!(long.len(), 250);
        let n = copy_name("ns", &long, "dfw");
        assert_eq!(n.len(), MAX_NAME_LEN);
        assert!(
            n.len() + "-networkinterface".len() <= 253,
            "Karmada's binding name fits"
        );
        assert!(n.ends_with("-dfw"));
        assert_eq!(n, copy_name("ns", &long, "dfw"), "stable");
        assert_ne!(n, copy_name("ns2", &long, "dfw"), "namespace is part of the hash");
        assert_ne!(n, copy_name("ns", &long, "sjc"));
        let other = format!("{}y", &long[..249]);
        assert_ne!(
            n,
            copy_name("ns", &other, "dfw"),
            "names sharing the cut prefix stay distinct"
        );
        // The cut never leaves a '-' or '.' before the hash separator.
        let dashy = format!("{}-{}", "a".repeat(232), "b".repeat(30));
        let n = copy_name("ns", &dashy, "dfw");
        assert!(!n.contains("--"), "{n}");
        let max_loc = "l".repeat(63);
        assert!(copy_name("ns", &"z".repeat(253), &max_loc).len() <= MAX_NAME_LEN);
    }

    #[test]
    fn in_sync_ignores_foreign_fields_and_sees_owned_drift() {
        let d = publish("networkinterfaces", interface());
        let mut hub = d.object.clone();
        hub["metadata"]["labels"]["propagationpolicy.karmada.io/name"] = json!("p");
        hub["metadata"]["resourceVersion"] = json!("5");
        hub["spec"]["mtu"] = json!(1500);
        hub["status"] = d.status.as_ref().unwrap()["status"].clone();
        assert!(in_sync(&d, &obj(hub.clone())));

        let mut listed = hub.clone();
        listed.as_object_mut().unwrap().remove("apiVersion");
        listed.as_object_mut().unwrap().remove("kind");
        let mut listed = obj(listed);
        listed.types = None;
        assert!(
            in_sync(&d, &listed),
            "a LIST item without apiVersion/kind is still in sync"
        );

        let mut edited = hub.clone();
        edited["spec"]["network"]["name"] = json!("other");
        assert!(!in_sync(&d, &obj(edited)), "an owned field edited on the hub is drift");

        let mut status_lost = hub.clone();
        status_lost.as_object_mut().unwrap().remove("status");
        assert!(!in_sync(&d, &obj(status_lost)));

        let mut stale = hub;
        stale["metadata"]["annotations"][CONTENT_HASH_ANNOTATION] = json!("old");
        assert!(!in_sync(&d, &obj(stale)));
    }

    #[test]
    fn a_source_without_carried_status_needs_no_status_write() {
        let mut source = interface();
        source.as_object_mut().unwrap().remove("status");
        let d = publish("networkinterfaces", source.clone());
        assert_eq!(d.status.as_ref().unwrap()["status"], json!({}));
        assert!(status_in_sync(&d, None), "no empty status apply on create");
        let copy = obj(d.object.clone());
        assert!(status_in_sync(&d, Some(&copy)), "a copy without status is current");
        assert!(in_sync(&d, &copy), "nor is it rewritten by a restart");

        // Status the source only has outside the carried paths changes nothing either.
        source["status"] = json!({"vpc": "v-1"});
        let d = publish("networkinterfaces", source);
        assert!(status_in_sync(&d, None));
    }

    #[test]
    fn a_carried_status_field_gone_from_the_source_is_cleared_on_the_copy() {
        let before = publish("networkinterfaces", interface());
        let mut hub = before.object.clone();
        hub["status"] = before.status.as_ref().unwrap()["status"].clone();
        let mut source = interface();
        source["status"].as_object_mut().unwrap().remove("phase");
        let after = publish("networkinterfaces", source);
        assert!(
            !status_in_sync(&after, Some(&obj(hub.clone()))),
            "the copy still shows the old phase"
        );
        hub["status"].as_object_mut().unwrap().remove("phase");
        assert!(status_in_sync(&after, Some(&obj(hub))));
    }

    #[test]
    fn status_in_sync_looks_at_the_carried_status_only() {
        let d = publish("networkinterfaces", interface());
        let mut hub = d.object.clone();
        hub["status"] = d.status.as_ref().unwrap()["status"].clone();
        hub["status"]["observedByHub"] = json!(true);
        assert!(
            status_in_sync(&d, Some(&obj(hub.clone()))),
            "fields others own are ignored"
        );
        hub["metadata"]["labels"]["compute.datumapis.com/workload"] = json!("other");
        assert!(
            status_in_sync(&d, Some(&obj(hub.clone()))),
            "a label change leaves the status current"
        );
        hub["status"]["phase"] = json!("Pending");
        assert!(!status_in_sync(&d, Some(&obj(hub.clone()))));
        hub.as_object_mut().unwrap().remove("status");
        assert!(!status_in_sync(&d, Some(&obj(hub))), "a copy without status needs one");
        assert!(!status_in_sync(&d, None), "a create carrying status writes it");
        let network = publish(
            "networks",
            json!({"apiVersion": "networking.datumapis.com/v1alpha", "kind": "Network",
            "metadata": {"name": "n", "namespace": "ns"}, "spec": {"ipam": {}}}),
        );
        assert!(
            status_in_sync(&network, Some(&obj(network.object.clone()))),
            "spec-only kinds never write status"
        );
    }

    #[test]
    fn published_by_checks_the_location_label() {
        let d = publish(
            "networks",
            json!({"apiVersion": "networking.datumapis.com/v1alpha", "kind": "Network",
            "metadata": {"name": "n", "namespace": "ns"}, "spec": {"ipam": {}}}),
        );
        let copy = obj(d.object);
        assert!(published_by(&copy, "dfw"));
        assert!(!published_by(&copy, "sjc"));
    }

    #[test]
    fn contains_semantics() {
        assert!(contains(&json!({"a": 1, "b": 2}), &json!({"a": 1})));
        assert!(!contains(&json!({"a": [1, 2]}), &json!({"a": [1]})));
        assert!(contains(&json!({"a": [{"x": 1, "y": 2}]}), &json!({"a": [{"x": 1}]})));
        assert!(contains(&json!({}), &json!({"a": null})));
        assert!(!contains(&json!({}), &json!({"a": 1})));
    }
}
