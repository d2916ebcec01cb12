//! One pass over one NetworkService: its EndpointSlices, then its status and the Events of
//! its condition transitions.

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

use super::{
    ClassLabels, Controller, FIELD_MANAGER, Key, ServiceLabels,
    endpoints::{self, Ownership},
    rollup::{self, SlicesOutcome},
    selector_of, service_resource, typed,
};

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

#[cfg(test)]
mod tests {
    //! One service pass against a mock hub (`tower-test`): the exact slice and status apply
    //! bodies, a slice name held by a hand-made slice, and a transient slice failure.

    use std::time::Duration;

    use http::{Method, Request, Response, StatusCode};
    use kube::{Client, client::Body, runtime::watcher::Event};
    use prometheus_client::registry::Registry;
    use serde_json::{Value, json};
    use tower_test::mock;

    use super::*;
    use crate::{cluster::HubHealth, membership::Writers};

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/team/endpointslices";
    const SERVICES: &str = "/apis/networking.datumapis.com/v1alpha/namespaces/team/networkservices";

    /// A controller over a mock hub whose caches hold service `web` (port `http` 8080, selecting
    /// workload `web`), namespace `team` routed to `cluster-p`, and one interface per
    /// `(name, location, address, healthy)`.
    fn fixture(interfaces: &[(&str, &str, &str, bool)]) -> (Arc<Controller>, Writers, Handle) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let (controller, mut writers) = Controller::new(
            Client::new(service, "default"),
            HubHealth::new(),
            super::super::Metrics::register(&mut Registry::default()),
        );
        let apply = |o: Value| Event::Apply(serde_json::from_value::<kube::api::DynamicObject>(o).unwrap());
        writers.services.apply_watcher_event(&apply(json!({
            "apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkService",
            "metadata": {"name": "web", "namespace": "team", "uid": "svc-1", "generation": 3},
            "spec": {
                "networkInterfaces": {"selector": {"matchLabels": {"compute.datumapis.com/workload": "web"}}},
                "ports": [{"name": "http", "port": 8080}]
            }
        })));
        for (name, location, address, healthy) in interfaces {
            let (status, reason) = if *healthy {
                ("True", "HolderAvailable")
            } else {
                ("False", "HolderUnavailable")
            };
            writers.interfaces.apply_watcher_event(&apply(json!({
                "apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkInterface",
                "metadata": {"name": name, "namespace": "team", "labels": {
                    "compute.datumapis.com/workload": "web",
                    "networking.datumapis.com/location": location,
                    "replicator.datumapis.com/location": location,
                }},
                "spec": {"network": {"name": "default"}, "addresses": [{"family": "IPv6", "address": address, "primary": true}]},
                "status": {"phase": "Bound", "conditions": [{"type": "HolderAvailable", "status": status, "reason": reason,
                    "message": "", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
            })));
        }
        writers.namespaces.apply_watcher_event(&Event::Apply(
            serde_json::from_value(json!({"metadata": {"name": "team", "labels": {
                "meta.datumapis.com/upstream-cluster-name": "cluster-p",
                "meta.datumapis.com/upstream-namespace": "ns-p"
            }}}))
            .unwrap(),
        ));
        (controller, writers, handle)
    }

    /// The next request (method, path and query, JSON body), answered with `status` and `body`.
    async fn answer(hub: &mut Handle, status: StatusCode, body: Value) -> (Method, String, Value) {
        let (request, respond) = tokio::time::timeout(Duration::from_secs(5), hub.next_request())
            .await
            .expect("a request within 5 s")
            .expect("the client is alive");
        let (method, uri) = (request.method().clone(), request.uri().to_string());
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let sent = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        respond.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
        (method, uri, sent)
    }

    /// What the hub answers to an apply of slice `web-http` (its body is not read back).
    fn slice_answer() -> Value {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "web-http", "namespace": "team", "uid": "slice-1"},
               "addressType": "IPv6", "endpoints": []})
    }

    /// What the hub answers to a status apply of service `web`.
    fn service_answer() -> Value {
        json!({"apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkService",
               "metadata": {"name": "web", "namespace": "team", "uid": "svc-1"},
               "spec": {"networkInterfaces": {"selector": {}}, "ports": []}})
    }

    fn not_found() -> Value {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": "not found"})
    }

    /// Answers the Events the pass publishes until it ends; returns its result and the reasons.
    async fn finish(
        hub: &mut Handle,
        pass: tokio::task::JoinHandle<Result<bool, kube::Error>>,
    ) -> (Result<bool, kube::Error>, Vec<String>) {
        let mut reasons = Vec::new();
        tokio::pin!(pass);
        loop {
            tokio::select! {
                done = &mut pass => return (done.unwrap(), reasons),
                next = hub.next_request() => {
                    let (request, respond) = next.expect("the client is alive");
                    // A new Event is created; one the recorder has sent before is patched (a series).
                    let path = request.uri().path().to_owned();
                    let created = request.method() == Method::POST && path == "/apis/events.k8s.io/v1/namespaces/team/events";
                    let patched = request.method() == Method::PATCH && path.starts_with("/apis/events.k8s.io/v1/namespaces/team/events/web.");
                    assert!(created || patched, "only Events: {} {path}", request.method());
                    let bytes = request.into_body().collect_bytes().await.unwrap();
                    let event: Value = serde_json::from_slice(&bytes).unwrap();
                    if created {
                        assert_eq!(event["regarding"]["name"], "web");
                        reasons.push(event["reason"].as_str().unwrap_or_default().to_owned());
                    }
                    respond.send_response(Response::builder().status(201).body(Body::from(b"{}".to_vec())).unwrap());
                }
            }
        }
    }

    fn pass(controller: &Arc<Controller>) -> tokio::task::JoinHandle<Result<bool, kube::Error>> {
        let controller = Arc::clone(controller);
        tokio::spawn(async move { controller.reconcile(&("team".into(), "web".into())).await })
    }

    fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
        status["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
            .unwrap_or(&Value::Null)
    }

    #[tokio::test]
    async fn a_pass_applies_the_slice_then_the_status_under_its_field_manager() {
        let (controller, _writers, mut hub) = fixture(&[("a", "dfw", "fd00::a", true), ("b", "sjc", "fd00::b", false)]);
        let running = pass(&controller);
        let read = answer(&mut hub, StatusCode::NOT_FOUND, not_found()).await;
        assert_eq!((read.0, read.1), (Method::GET, format!("{SLICES}/web-http")));
        let (method, uri, slice) = answer(&mut hub, StatusCode::CREATED, slice_answer()).await;
        assert_eq!(method, Method::PATCH);
        assert_eq!(
            uri,
            format!("{SLICES}/web-http?&force=true&fieldManager=replicator-membership")
        );
        assert_eq!(slice["addressType"], "IPv6");
        assert_eq!(slice["metadata"]["labels"]["kubernetes.io/service-name"], "web-http");
        assert_eq!(
            slice["metadata"]["labels"]["meta.datumapis.com/upstream-cluster-name"],
            "cluster-p"
        );
        assert_eq!(
            slice["metadata"]["ownerReferences"][0],
            json!({"apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkService", "name": "web",
                   "uid": "svc-1", "controller": true})
        );
        let endpoints: Vec<(Value, Value, Value)> = slice["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["addresses"].clone(),
                    e["zone"].clone(),
                    e["conditions"]["ready"].clone(),
                )
            })
            .collect();
        assert_eq!(
            endpoints,
            [
                (json!(["fd00::a"]), json!("dfw"), json!(true)),
                (json!(["fd00::b"]), json!("sjc"), json!(false))
            ]
        );
        assert_eq!(
            slice["ports"],
            json!([{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}])
        );
        let (method, uri, body) = answer(&mut hub, StatusCode::OK, service_answer()).await;
        assert_eq!(method, Method::PATCH);
        assert_eq!(
            uri,
            format!("{SERVICES}/web/status?&force=true&fieldManager=replicator-membership")
        );
        let status = &body["status"];
        assert_eq!(body["metadata"], json!({"name": "web", "namespace": "team"}));
        assert_eq!(status["observedGeneration"], 3);
        assert_eq!(condition(status, "SlicesPublished")["status"], "True");
        let (result, reasons) = finish(&mut hub, running).await;
        assert!(!result.unwrap(), "nothing to look at again");
        assert!(!reasons.is_empty(), "condition transitions are Events");
        assert_eq!(controller.metrics.status_writes.get(), 1);
    }

    #[tokio::test]
    async fn a_slice_name_held_by_a_hand_made_slice_is_left_alone_and_reported() {
        let (controller, _writers, mut hub) = fixture(&[("a", "dfw", "fd00::a", true)]);
        let running = pass(&controller);
        let hand_made = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-http", "namespace": "team", "uid": "hand-1"},
            "addressType": "IPv6", "endpoints": []});
        answer(&mut hub, StatusCode::OK, hand_made).await;
        // No write to the slice: the next request is the status.
        let (method, uri, body) = answer(&mut hub, StatusCode::OK, service_answer()).await;
        assert_eq!(
            (method, uri),
            (
                Method::PATCH,
                format!("{SERVICES}/web/status?&force=true&fieldManager=replicator-membership")
            )
        );
        let published = condition(&body["status"], "SlicesPublished");
        assert_eq!(
            (published["status"].clone(), published["reason"].clone()),
            (json!("False"), json!("SliceNameConflict"))
        );
        let (result, _) = finish(&mut hub, running).await;
        assert!(result.unwrap(), "looked at again later");
        let labels = ServiceLabels {
            namespace: "team".into(),
            service: "web".into(),
        };
        assert_eq!(controller.metrics.slice_conflicts.get_or_create(&labels).get(), 1);
    }

    #[tokio::test]
    async fn a_transient_slice_failure_still_writes_the_status_and_fails_the_pass() {
        let (controller, _writers, mut hub) = fixture(&[("a", "dfw", "fd00::a", true)]);
        let running = pass(&controller);
        answer(&mut hub, StatusCode::NOT_FOUND, not_found()).await;
        let unavailable = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
            "reason": "ServiceUnavailable", "message": "etcd leader changed"});
        answer(&mut hub, StatusCode::SERVICE_UNAVAILABLE, unavailable).await;
        let (method, uri, body) = answer(&mut hub, StatusCode::OK, service_answer()).await;
        assert_eq!((method, uri.contains("/status?")), (Method::PATCH, true));
        assert_eq!(condition(&body["status"], "SlicesPublished")["status"], "False");
        let (result, _) = finish(&mut hub, running).await;
        let err = result.unwrap_err();
        assert_eq!(classify(&err), ErrorClass::Transient, "{err}");
    }
}
