//! The floor: a minimal relay built for the benchmark. It watches one cell and server-side
//! applies each object to the hub, and nothing else (no cache, no queue, no drift check, no
//! status subresource, no ownership check). Whatever the replicator does on top costs time; the
//! relay's lag is what this machine's apiservers and watches cost by themselves.
//!
//! It watches the same sources as the replicator (the default rules' server-side selectors for
//! galactic EndpointSlices and NetworkInterfaces), names copies the same way
//! (`<name>-<location>`), and writes with as many concurrent writers (for both kinds together) as
//! the replicator has workers: events are sharded by object, so the writes of one object stay in
//! order.
//!
//! The relay of a cell's location `dfw` publishes under a location of its own,
//! [`hub_location`]`("dfw")` = `dfw-relay`: it writes to the hub as that location's identity
//! (`replicator-dfw-relay`, bound like every location's), and its copies are that location's
//! copies (label `replicator.datumapis.com/location=dfw-relay`, names ending in `-dfw-relay`,
//! plus [`RELAY_LABEL`]), so the hub's admission policies admit them as they admit a
//! replicator's, and every relay write pays for admission as the replicator's do. The replicator
//! of `dfw` never touches them: it writes, repairs and sweeps only copies labelled `dfw`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash as _, Hasher as _};

use futures::StreamExt as _;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{Expression, Selector};
use kube::discovery::ApiResource;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt as _};
use replicator::rules::{self, default_rules};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

/// The label on relay copies; its value is the relay's location ([`hub_location`]).
pub const RELAY_LABEL: &str = "replicator-bench.datumapis.com/relay";

/// The location the relay of a cell at `cell_location` publishes under on the hub:
/// `<cell_location>-relay`, a DNS label and so a location of its own, with its own hub identity
/// `replicator-<cell_location>-relay`; a copy name ending in it never ends in `-<cell_location>`.
pub fn hub_location(cell_location: &str) -> String {
    format!("{cell_location}-relay")
}

/// One relayed change: the object to apply, or (`object: None`) a deleted one.
struct Change {
    resource: ApiResource,
    namespace: String,
    name: String,
    object: Option<Box<DynamicObject>>,
}

/// Runs the relay until the process ends: one watch per kind on `cell`, `workers` concurrent hub
/// writers, copies published under `location` (the relay's own hub location, [`hub_location`]:
/// their name suffix and location label; `hub` should be that location's identity).
///
/// Without `source_label` it watches what the replicator watches (the default rules' selectors
/// with the loop guard). With `source_label` (`key`, `value`) it watches the rules' own selectors
/// plus `key=value` instead: the benchmark gives the relay's sources the replicator's loop-guard
/// label, so the two mirrors run side by side over disjoint sources and their churn windows can
/// alternate (`crate::bench`). That label is not carried to the copies.
///
/// # Errors
/// When a rule of the two kinds is missing from the default rules, or its selector is invalid.
pub async fn run(
    cell: Client,
    hub: Client,
    location: String,
    workers: usize,
    source_label: Option<(String, String)>,
) -> anyhow::Result<()> {
    let workers = workers.max(1);
    let mut tasks = tokio::task::JoinSet::new();
    // One set of writers for both kinds, as the replicator's workers serve every kind.
    let (shards, receivers): (Vec<_>, Vec<_>) = (0..workers).map(|_| mpsc::unbounded_channel::<Change>()).unzip();
    for rx in receivers {
        tasks.spawn(write(hub.clone(), location.clone(), rx));
    }
    for kinds in ["endpointslices", "networkinterfaces"] {
        let rule = default_rules()
            .into_iter()
            .find(|r| r.name == kinds)
            .ok_or_else(|| anyhow::anyhow!("no default rule {kinds}"))?;
        let resource = rule.resource.api_resource();
        let selector = match &source_label {
            None => rules::source_selector(&rule)?,
            Some((key, value)) => {
                let mut selector = match &rule.source_selector {
                    Some(own) => Selector::try_from(own.clone())?,
                    None => Selector::default(),
                };
                selector.extend([Expression::Equal(key.clone(), value.clone())]);
                selector
            }
        };
        let shards = shards.clone();
        let api = Api::<DynamicObject>::all_with(cell.clone(), &resource);
        let config = watcher::Config::default().labels_from(&selector);
        tasks.spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(api, config));
            while let Some(event) = events.next().await {
                let (namespace, name, object) = match event {
                    Ok(Event::Apply(o) | Event::InitApply(o)) => {
                        (o.namespace().unwrap_or_default(), o.name_any(), Some(o))
                    }
                    Ok(Event::Delete(o)) => (o.namespace().unwrap_or_default(), o.name_any(), None),
                    Ok(Event::Init | Event::InitDone) => continue,
                    Err(error) => {
                        tracing::warn!(%error, "relay watch failed; retrying");
                        continue;
                    }
                };
                let mut hasher = DefaultHasher::new();
                (&resource.kind, &namespace, &name).hash(&mut hasher);
                let shard = (hasher.finish() % shards.len() as u64) as usize;
                let change = Change {
                    resource: resource.clone(),
                    namespace,
                    name,
                    object: object.map(Box::new),
                };
                if shards[shard].send(change).is_err() {
                    return;
                }
            }
        });
    }
    drop(shards);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// The relay copy of `source`: its labels (the replicator's location label set to `location`,
/// the relay's hub location, in place of the source's loop guard, plus [`RELAY_LABEL`]),
/// annotations and every top-level field but `metadata` and `status`, named
/// `<name>-<location>`: a copy of `location` as the hub's admission policies define one.
pub fn relay_copy(source: &DynamicObject, resource: &ApiResource, location: &str) -> Value {
    let mut labels = source.labels().clone();
    labels.insert(rules::LOCATION_LABEL.to_owned(), location.to_owned());
    labels.insert(RELAY_LABEL.to_owned(), location.to_owned());
    let mut body = match &source.data {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    body.remove("status");
    body.insert("apiVersion".into(), json!(resource.api_version));
    body.insert("kind".into(), json!(resource.kind));
    body.insert(
        "metadata".into(),
        json!({
            "name": format!("{}-{location}", source.name_any()),
            "namespace": source.namespace(),
            "labels": labels,
            "annotations": source.annotations(),
        }),
    );
    Value::Object(body)
}

async fn write(hub: Client, location: String, mut rx: mpsc::UnboundedReceiver<Change>) {
    let params = PatchParams::apply(&format!("relay-{location}")).force();
    while let Some(change) = rx.recv().await {
        let api = Api::<DynamicObject>::namespaced_with(hub.clone(), &change.namespace, &change.resource);
        let copy = format!("{}-{location}", change.name);
        let result = match &change.object {
            Some(source) => {
                let body = relay_copy(source, &change.resource, &location);
                api.patch(&copy, &params, &Patch::Apply(&body)).await.map(drop)
            }
            None => match api.delete(&copy, &DeleteParams::default()).await {
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                other => other.map(drop),
            },
        };
        if let Err(error) = result {
            tracing::warn!(%error, "relay write failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_copy_is_a_copy_of_the_relays_own_location() {
        let location = hub_location("dfw");
        assert_eq!(location, "dfw-relay");
        crate::rbac::validate_location(&location).expect("a location that can name a hub identity");
        let resource = ApiResource {
            group: "discovery.k8s.io".into(),
            version: "v1".into(),
            api_version: "discovery.k8s.io/v1".into(),
            kind: "EndpointSlice".into(),
            plural: "endpointslices".into(),
        };
        let source: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "es-000001",
                "namespace": "bench-relay",
                "labels": {rules::LOCATION_LABEL: "relay-source", "compute.datumapis.com/bench-seq": "7"},
                "annotations": {"a": "b"},
            },
            "addressType": "IPv6",
            "endpoints": [],
            "status": {"x": 1},
        }))
        .expect("a valid object");
        let copy = relay_copy(&source, &resource, &location);
        let name = copy["metadata"]["name"].as_str().unwrap_or_default();
        assert_eq!(name, "es-000001-dfw-relay");
        assert!(!name.ends_with("-dfw"), "never a name of the replicator of dfw");
        let labels = &copy["metadata"]["labels"];
        assert_eq!(labels[rules::LOCATION_LABEL], "dfw-relay", "the loop guard is replaced");
        assert_eq!(labels[RELAY_LABEL], "dfw-relay");
        assert_eq!(labels["compute.datumapis.com/bench-seq"], "7");
        assert_eq!(copy["metadata"]["annotations"]["a"], "b");
        assert_eq!(copy["addressType"], "IPv6");
        assert!(copy.get("status").is_none());
    }
}
