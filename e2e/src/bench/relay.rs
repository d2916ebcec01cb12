//! The floor: a minimal relay built for the benchmark. It watches one cell and server-side
//! applies each object to the hub, and nothing else (no cache, no queue, no drift check, no
//! status subresource, no ownership check). Whatever the replicator does on top costs time; the
//! relay's lag is what this machine's apiservers and watches cost by themselves.
//!
//! It watches the same sources as the replicator (the default rules' server-side selectors for
//! galactic EndpointSlices and NetworkInterfaces), names copies the same way
//! (`<name>-<location>`), and writes with as many concurrent writers (for both kinds together) as
//! the replicator has workers: events are sharded by object, so the writes of one object stay in
//! order. Copies
//! carry [`RELAY_LABEL`] instead of the replicator's location label.

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

/// The label on relay copies; its value is the relay's location.
pub const RELAY_LABEL: &str = "replicator-bench.datumapis.com/relay";

/// One relayed change: the object to apply, or (`object: None`) a deleted one.
struct Change {
    resource: ApiResource,
    namespace: String,
    name: String,
    object: Option<Box<DynamicObject>>,
}

/// Runs the relay for `location` until the process ends: one watch per kind on `cell`, `workers`
/// concurrent hub writers.
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

/// The relay copy of `source`: its labels (without the replicator's location label, plus
/// [`RELAY_LABEL`]), annotations and every
/// top-level field but `metadata` and `status`, named `<name>-<location>`.
pub fn relay_copy(source: &DynamicObject, resource: &ApiResource, location: &str) -> Value {
    let mut labels = source.labels().clone();
    labels.remove(rules::LOCATION_LABEL);
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
