//! One pass over one NetworkService: its EndpointSlices, then its status and the Events of
//! its condition transitions.

use super::endpoints::{self, Ownership};
use super::rollup::{self, SlicesOutcome};

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
};

use k8s_openapi::{api::discovery::v1::EndpointSlice, jiff::Timestamp};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, Preconditions},
    runtime::{
        events::{Event as KubeEvent, EventType},
        reflector::ObjectRef,
    },
};
use serde_json::json;

use crate::{
    api::{NetworkInterface, NetworkService, NetworkServiceStatus},
    api_errors::{ErrorClass, classify},
    copy, routing,
};

use super::{ClassLabels, Controller, FIELD_MANAGER, Key, ServiceLabels, selector_of, service_resource, typed};

impl Controller {
    /// One pass over one service: slices first, then the status, which is written (when it
    /// changed) whatever the slices did, so a refused or taken slice never freezes it. Returns
    /// whether to look again after [`RECHECK`] (a slice is taken or refused).
    ///
    /// # Errors
    /// The status write failing, or a transient slice failure (after the status is written).
    pub(super) async fn reconcile(&self, key: &Key) -> Result<bool, kube::Error> {
        let (namespace, name) = key;
        let labels = ServiceLabels {
            namespace: namespace.clone(),
            service: name.clone(),
        };
        let Some(raw) = self
            .services
            .get(&ObjectRef::new_with(name, service_resource()).within(namespace))
        else {
            self.metrics.members.remove(&labels);
            self.metrics.healthy.remove(&labels);
            self.metrics.slice_conflicts.remove(&labels);
            self.metrics.slices_rejected.remove(&labels);
            return Ok(false);
        };
        if raw.metadata.deletion_timestamp.is_some() {
            return Ok(false);
        }
        let Some(service) = typed::<NetworkService>(&raw) else {
            tracing::warn!("service does not match the NetworkService schema; skipped until it changes");
            self.metrics
                .errors
                .get_or_create(&ClassLabels {
                    class: ErrorClass::Invalid.metric_label(),
                })
                .inc();
            return Ok(false);
        };
        let interfaces: Vec<NetworkInterface> = self
            .interfaces
            .state_filter(|i| i.namespace().as_deref() == Some(namespace.as_str()))
            .iter()
            .filter_map(|i| typed::<NetworkInterface>(i))
            .collect();
        let resolution = rollup::resolve(selector_of(&service), &interfaces);
        let members = resolution.members();
        self.metrics.members.get_or_create(&labels).set(members.len() as i64);
        self.metrics
            .healthy
            .get_or_create(&labels)
            .set(members.iter().filter(|m| m.healthy && m.location.is_some()).count() as i64);

        let routing_labels: BTreeMap<String, String> = self
            .namespaces
            .get(&ObjectRef::new(namespace))
            .and_then(|ns| routing::resolve(namespace, Some(ns.labels())).ok())
            .map(|r| {
                r.labels()
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let (outcome, transient) = match endpoints::desired(&service, members, &routing_labels) {
            Ok(desired) => self.apply_slices(&service, desired).await,
            Err(err) => {
                tracing::warn!(error = %err, "no EndpointSlice planned");
                let (outcome, transient) = self.apply_slices(&service, Vec::new()).await;
                let outcome = match outcome {
                    SlicesOutcome::Pending(m) => SlicesOutcome::Pending(m),
                    _ => SlicesOutcome::InvalidName(err.to_string()),
                };
                (outcome, transient)
            }
        };
        let (conflicts, rejected) = match &outcome {
            SlicesOutcome::Conflicts(c) => (c.len(), 0),
            SlicesOutcome::Rejected(r) => (0, r.len()),
            _ => (0, 0),
        };
        self.metrics
            .slice_conflicts
            .get_or_create(&labels)
            .set(conflicts as i64);
        self.metrics.slices_rejected.get_or_create(&labels).set(rejected as i64);
        let recheck = matches!(outcome, SlicesOutcome::Conflicts(_) | SlicesOutcome::Rejected(_));

        let previous = service.status.clone();
        let now = Timestamp::now();
        let status = rollup::status(service.metadata.generation, &resolution, previous.as_ref(), now);
        let status = rollup::with_slices(status, &outcome, service.metadata.generation, previous.as_ref(), now);
        if previous.as_ref() != Some(&status) {
            let api = Api::<NetworkService>::namespaced(self.hub.clone(), namespace);
            let body = json!({
                "apiVersion": format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
                "kind": "NetworkService",
                "metadata": {"name": name, "namespace": namespace},
                "status": status,
            });
            api.patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&body))
                .await?;
            self.metrics.status_writes.inc();
            self.publish_transitions(&service, previous.as_ref(), &status).await;
        }
        match transient {
            Some(err) => Err(err),
            None => Ok(recheck),
        }
    }

    /// The slice of `name` in `namespace`: from the cache (slices carrying the network-service
    /// label), else read from the hub (a slice without the label, a hand-made one, is not
    /// cached but must not be overwritten either).
    pub(super) async fn current_slice(
        &self,
        api: &Api<EndpointSlice>,
        namespace: &str,
        name: &str,
    ) -> Result<Option<EndpointSlice>, kube::Error> {
        if let Some(cached) = self.slices.get(&ObjectRef::new(name).within(namespace)) {
            return Ok(Some(cached.as_ref().clone()));
        }
        api.get_opt(name).await
    }

    /// Writes `desired` for `service` and deletes the slices it controls that are no longer
    /// desired. A name held by a slice that is not the service's is left untouched and reported
    /// ([`endpoints::ownership`]); a slice of the service whose `addressType` (immutable) differs
    /// is deleted (UID precondition) and created again. Every slice is tried; the outcome lists
    /// what is taken or refused, and the first transient error is returned beside it.
    pub(super) async fn apply_slices(
        &self,
        service: &NetworkService,
        desired: Vec<EndpointSlice>,
    ) -> (SlicesOutcome, Option<kube::Error>) {
        let namespace = service.namespace().unwrap_or_default();
        let service_name = service.name_any();
        let uid = service.metadata.uid.clone().unwrap_or_default();
        let api = Api::<EndpointSlice>::namespaced(self.hub.clone(), &namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut conflicts = Vec::new();
        let mut rejected = Vec::new();
        let mut transient: Option<kube::Error> = None;
        let fail = |name: &str, err: kube::Error, rejected: &mut Vec<String>, transient: &mut Option<kube::Error>| {
            let class = classify(&err);
            match class {
                ErrorClass::Invalid | ErrorClass::Forbidden => {
                    self.metrics
                        .errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                    tracing::warn!(slice = name, error = %err, class = class.metric_label(), "the hub refused an EndpointSlice");
                    rejected.push(format!("EndpointSlice {name}: {}", error_message(&err)));
                }
                _ => {
                    if transient.is_none() {
                        *transient = Some(err);
                    }
                }
            }
        };
        let wanted: HashSet<String> = desired.iter().filter_map(|s| s.metadata.name.clone()).collect();
        for slice in desired {
            let Some(name) = slice.metadata.name.clone() else {
                continue;
            };
            let current = match self.current_slice(&api, &namespace, &name).await {
                Ok(c) => c,
                Err(err) => {
                    fail(&name, err, &mut rejected, &mut transient);
                    continue;
                }
            };
            match endpoints::ownership(current.as_ref(), &service_name, &uid) {
                Ownership::Taken(why) => {
                    tracing::warn!(slice = %name, reason = %why, "EndpointSlice name taken; not overwritten");
                    conflicts.push(why);
                    continue;
                }
                Ownership::Ours | Ownership::Free => {}
            }
            let mut body = match serde_json::to_value(&slice) {
                Ok(b) => b,
                Err(err) => {
                    fail(&name, kube::Error::SerdeError(err), &mut rejected, &mut transient);
                    continue;
                }
            };
            body["apiVersion"] = json!("discovery.k8s.io/v1");
            body["kind"] = json!("EndpointSlice");
            if let Some(c) = &current {
                let in_sync = serde_json::to_value(c)
                    .ok()
                    .is_some_and(|c| copy::contains(&c, &without_types(&body)) && endpoints_equal(&c, &body));
                if in_sync {
                    continue;
                }
                if c.address_type != slice.address_type {
                    let precondition = DeleteParams {
                        preconditions: Some(Preconditions {
                            uid: c.metadata.uid.clone(),
                            resource_version: None,
                        }),
                        ..DeleteParams::default()
                    };
                    match api.delete(&name, &precondition).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 404 => {}
                        Err(err) => {
                            fail(&name, err, &mut rejected, &mut transient);
                            continue;
                        }
                    }
                }
            }
            if let Err(err) = api.patch(&name, &params, &Patch::Apply(&body)).await {
                fail(&name, err, &mut rejected, &mut transient);
            }
        }
        let stale: Vec<Arc<EndpointSlice>> = self.slices.state_filter(|s| {
            s.namespace().as_deref() == Some(namespace.as_str())
                && !wanted.contains(&s.name_any())
                && s.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.uid == uid)
                && s.labels().get(endpoints::MANAGED_BY_LABEL).map(String::as_str) == Some(endpoints::MANAGED_BY)
        });
        for slice in stale {
            let precondition = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: slice.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&slice.name_any(), &precondition).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(err) => fail(&slice.name_any(), err, &mut rejected, &mut transient),
            }
        }
        let outcome = if let Some(err) = &transient {
            SlicesOutcome::Pending(error_message(err))
        } else if !rejected.is_empty() {
            conflicts.extend(rejected);
            SlicesOutcome::Rejected(conflicts)
        } else if !conflicts.is_empty() {
            SlicesOutcome::Conflicts(conflicts)
        } else {
            SlicesOutcome::Published
        };
        (outcome, transient)
    }

    pub(super) async fn publish_transitions(
        &self,
        service: &NetworkService,
        previous: Option<&NetworkServiceStatus>,
        status: &NetworkServiceStatus,
    ) {
        let reference = service.object_ref(&());
        for c in status.conditions.iter().flatten() {
            let before = previous
                .and_then(|p| p.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|p| p.type_ == c.type_));
            if before.is_some_and(|b| b.status == c.status && b.reason == c.reason) {
                continue;
            }
            let event = KubeEvent {
                type_: if c.status == "True" {
                    EventType::Normal
                } else {
                    EventType::Warning
                },
                reason: c.reason.clone(),
                note: Some(
                    format!("{} is {}: {}", c.type_, c.status, c.message)
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "Resolve".into(),
                secondary: None,
            };
            if let Err(err) = self.recorder.publish(&event, &reference).await {
                tracing::debug!(error = %err, "failed to publish event");
            }
        }
    }
}

/// The apiserver's message of `err` (its status message), else the error's text.
fn error_message(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

fn without_types(body: &serde_json::Value) -> serde_json::Value {
    let mut b = body.clone();
    if let Some(map) = b.as_object_mut() {
        map.remove("apiVersion");
        map.remove("kind");
    }
    b
}

/// Endpoint lists must match exactly in length (the subset check already compares elements).
fn endpoints_equal(current: &serde_json::Value, desired: &serde_json::Value) -> bool {
    let len = |v: &serde_json::Value| v.get("endpoints").and_then(|e| e.as_array()).map_or(0, Vec::len);
    len(current) == len(desired)
}
