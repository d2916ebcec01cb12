//! The floor: a minimal relay built for the benchmark. It watches one cell and server-side
//! applies each object to the hub, and nothing else (no cache, no queue, no drift check, no
//! status subresource, no ownership check). Whatever the replicator does on top costs time; the
//! relay's lag is what this machine's apiservers and watches cost by themselves.
//!
//! It watches the same sources as the replicator (the default rules' server-side selectors for
//! galactic EndpointSlices and NetworkInterfaces), names copies the same way
//! (`<name>-<location>`), and writes with as many concurrent writers as the replicator has
//! workers: events are sharded by object, so the writes of one object stay in order. Copies
//! carry [`RELAY_LABEL`] instead of the replicator's location label.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash as _, Hasher as _};

use futures::StreamExt as _;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt as _};
use replicator::rules::{self, default_rules};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

/// The label on relay copies; its value is the relay's location.
pub const RELAY_LABEL: &str = "replicator-bench.datumapis.com/relay";

/// One relayed change: the object to apply, or the name of a deleted one.
enum Change {
    Apply(Box<DynamicObject>),
    Delete { namespace: String, name: String },
}

/// Runs the relay for `location` until the process ends: one watch per kind on `cell`, `workers`
/// concurrent hub writers.
///
/// # Errors
/// When a rule of the two kinds is missing from the default rules.
pub async fn run(cell: Client, hub: Client, location: String, workers: usize) -> anyhow::Result<()> {
    let workers = workers.max(1);
    let mut tasks = tokio::task::JoinSet::new();
    let mut shards = Vec::new();
    for kinds in ["endpointslices", "networkinterfaces"] {
        let rule = default_rules()
            .into_iter()
            .find(|r| r.name == kinds)
            .ok_or_else(|| anyhow::anyhow!("no default rule {kinds}"))?;
        let resource = rule.resource.api_resource();
        let selector = rules::source_selector(&rule)?;
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..workers).map(|_| mpsc::unbounded_channel::<Change>()).unzip();
        for rx in rxs {
            tasks.spawn(write(hub.clone(), resource.clone(), location.clone(), rx));
        }
        shards.push(txs.clone());
        let api = Api::<DynamicObject>::all_with(cell.clone(), &resource);
        let config = watcher::Config::default().labels_from(&selector);
        tasks.spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(api, config));
            while let Some(event) = events.next().await {
                let change = match event {
                    Ok(Event::Apply(o) | Event::InitApply(o)) => Change::Apply(Box::new(o)),
                    Ok(Event::Delete(o)) => Change::Delete {
                        namespace: o.namespace().unwrap_or_default(),
                        name: o.name_any(),
                    },
                    Ok(Event::Init | Event::InitDone) => continue,
                    Err(error) => {
                        tracing::warn!(%error, "relay watch failed; retrying");
                        continue;
                    }
                };
                let (namespace, name) = match &change {
                    Change::Apply(o) => (o.namespace().unwrap_or_default(), o.name_any()),
                    Change::Delete { namespace, name } => (namespace.clone(), name.clone()),
                };
                let mut hasher = DefaultHasher::new();
                (namespace, name).hash(&mut hasher);
                let shard = (hasher.finish() % txs.len() as u64) as usize;
                if txs[shard].send(change).is_err() {
                    return;
                }
            }
        });
    }
    drop(shards);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// The relay copy of `source`: its labels (plus [`RELAY_LABEL`]), annotations and every
/// top-level field but `metadata` and `status`, named `<name>-<location>`.
pub fn relay_copy(source: &DynamicObject, resource: &ApiResource, location: &str) -> Value {
    let mut labels = source.labels().clone();
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

async fn write(hub: Client, resource: ApiResource, location: String, mut rx: mpsc::UnboundedReceiver<Change>) {
    let params = PatchParams::apply(&format!("relay-{location}")).force();
    while let Some(change) = rx.recv().await {
        let result = match change {
            Change::Apply(source) => {
                let namespace = source.namespace().unwrap_or_default();
                let api = Api::<DynamicObject>::namespaced_with(hub.clone(), &namespace, &resource);
                let body = relay_copy(&source, &resource, &location);
                let name = format!("{}-{location}", source.name_any());
                api.patch(&name, &params, &Patch::Apply(&body)).await.map(drop)
            }
            Change::Delete { namespace, name } => {
                let api = Api::<DynamicObject>::namespaced_with(hub.clone(), &namespace, &resource);
                match api
                    .delete(&format!("{name}-{location}"), &DeleteParams::default())
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    other => other.map(drop),
                }
            }
        };
        if let Err(error) = result {
            tracing::warn!(%error, "relay write failed");
        }
    }
}
