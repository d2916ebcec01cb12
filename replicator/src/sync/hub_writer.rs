//! The hub writer: server-side apply of a copy and its status, withdrawal with a UID
//! precondition, and the echo bookkeeping of each write.

use kube::{
    Api, ResourceExt,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, Preconditions},
};

use super::{CellSync, Error, Key, RuleState, lock};
use crate::{api_errors::is_immutable_change, cache, copy, echo::CopyId};

/// A write to a copy in flight (see [`crate::echo`]): events of the copy are held until it
/// ends. Ending it, also when the pass fails, panics or is dropped, gives the source a pass if an
/// event held meanwhile was not the write's echo.
pub(super) struct Writing<'a> {
    sync: &'a CellSync,
    key: &'a Key,
    pub(super) id: CopyId,
}

impl<'a> Writing<'a> {
    pub(super) fn begin(sync: &'a CellSync, key: &'a Key, copy_name: String) -> Writing<'a> {
        let id = (key.rule, key.namespace.clone(), copy_name);
        if sync.settings.echo_bookkeeping {
            lock(&sync.echoes).begin(id.clone());
        }
        Writing { sync, key, id }
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if self.sync.settings.echo_bookkeeping && lock(&self.sync.echoes).end(&self.id) {
            self.sync.queue.add(self.key.clone());
        }
    }
}

impl CellSync {
    /// Server-side applies `desired` to copy `id` (and its status, when the carried status
    /// differs from `existing`'s), recording each write's resourceVersion as an awaited echo.
    /// A copy the apiserver refuses to change because an immutable field differs
    /// ([`is_immutable_change`]) is replaced: deleted with the UID of `existing`, then created.
    /// Returns whether it was replaced.
    pub(super) async fn apply_copy(
        &self,
        api: &Api<DynamicObject>,
        id: &CopyId,
        desired: &copy::Desired,
        existing: Option<&DynamicObject>,
    ) -> Result<bool, Error> {
        let params = PatchParams::apply(&self.field_manager).force();
        let mut replaced = false;
        let applied = match api.patch(&desired.name, &params, &Patch::Apply(&desired.object)).await {
            Ok(applied) => applied,
            Err(kube::Error::Api(status)) if is_immutable_change(&status) && existing.is_some() => {
                // The source was re-created with another value of an immutable field (a slice's
                // addressType) while nothing watched: no apply can ever bring the copy along.
                // Replace it: delete exactly the copy read (UID precondition), then create.
                let uid = existing.and_then(ResourceExt::uid);
                tracing::info!(copy = %desired.name, reason = %status.message, "replacing the copy: an immutable field differs from its source");
                self.delete_uid(api, &desired.name, uid).await?;
                replaced = true;
                api.patch(&desired.name, &params, &Patch::Apply(&desired.object))
                    .await
                    .map_err(Error::Hub)?
            }
            Err(e) => return Err(Error::Hub(e)),
        };
        self.record_echo(id, applied.resource_version());
        // A change that leaves the carried status as the copy has it (a label, a spec field)
        // needs no status write.
        let status_current = copy::status_in_sync(desired, existing);
        if let Some(status) = desired.status.as_ref().filter(|_| !status_current) {
            let applied = api
                .patch_status(&desired.name, &params, &Patch::Apply(status))
                .await
                .map_err(Error::Hub)?;
            self.record_echo(id, applied.resource_version());
        }
        Ok(replaced)
    }

    /// Deletes this location's copy `namespace/name` if it exists (UID precondition). Returns
    /// whether a delete was sent. A same-named object without our label is never touched.
    ///
    /// The copy in the hub cache (selected by our label) names the UID to delete without a read;
    /// only when the cache has none, or its UID is stale (409), is the copy read first.
    pub async fn withdraw(&self, state: &RuleState, namespace: &str, name: &str) -> Result<bool, Error> {
        let api = Api::<DynamicObject>::namespaced_with(self.hub.clone(), namespace, &state.resource);
        let cached = state
            .copies
            .get(&cache::key(namespace, name))
            .and_then(|copy| copy.object().ok())
            .filter(|copy| self.ours(copy));
        if let Some(copy) = cached {
            match self.delete_uid(&api, name, copy.uid()).await? {
                Some(deleted) => return Ok(deleted),
                None => tracing::debug!(copy = %name, "cached UID is stale; reading the copy"),
            }
        }
        // A quorum read (metadata is enough: the delete is conditional on the UID read). Not the
        // watch cache: this path runs when our cache is behind, and a cache as far behind would
        // name the same stale UID, or miss a copy just created, and leave the copy in place.
        let Some(copy) = api.get_metadata_opt(name).await.map_err(Error::Hub)? else {
            return Ok(false);
        };
        if !self.ours(&copy) {
            tracing::warn!(copy = %name, "not withdrawing: the hub object is not this location's copy from this cell");
            return Ok(false);
        }
        Ok(self.delete_uid(&api, name, copy.uid()).await?.unwrap_or(false))
    }

    /// Records the resourceVersion a write to copy `id` returned as an awaited echo.
    fn record_echo(&self, id: &CopyId, resource_version: Option<String>) {
        if self.settings.echo_bookkeeping {
            lock(&self.echoes).wrote(id, resource_version);
        }
    }

    /// Deletes this location's copy `namespace/name` of rule `state` if its UID is `uid` (the
    /// sweep's collection): `Some(true)` deleted, `Some(false)` already gone, `None` the UID did
    /// not match (the copy was replaced since it was read).
    ///
    /// # Errors
    /// [`Error::Hub`] for any other failure.
    pub(crate) async fn delete_copy(
        &self,
        state: &RuleState,
        namespace: &str,
        name: &str,
        uid: Option<String>,
    ) -> Result<Option<bool>, Error> {
        let api = Api::<DynamicObject>::namespaced_with(self.hub.clone(), namespace, &state.resource);
        self.delete_uid(&api, name, uid).await
    }

    /// Deletes `name` if its UID is `uid`: `Some(true)` deleted, `Some(false)` already gone,
    /// `None` the UID did not match (409).
    pub(super) async fn delete_uid(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
        uid: Option<String>,
    ) -> Result<Option<bool>, Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => Ok(Some(true)),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(Some(false)),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(Error::Hub(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The hub writer against a mock apiserver (`tower-test`): the exact requests it sends, and
    //! what it does with each answer.

    use std::sync::Arc;

    use http::{Method, StatusCode};
    use serde_json::{Value, json};

    use super::*;
    use crate::{
        echo::Seen,
        rules,
        sync::testing::{answer, fixture},
    };

    const COPIES: &str = "/apis/networking.datumapis.com/v1alpha/namespaces/team/networks";

    fn network(name: &str, uid: &str, resource_version: &str, location: &str) -> Value {
        json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "Network",
            "metadata": {
                "name": name,
                "namespace": "team",
                "uid": uid,
                "resourceVersion": resource_version,
                "labels": {"replicator.datumapis.com/location": location},
                "annotations": {"replicator.datumapis.com/cell": "cell-1"},
            },
        })
    }

    fn status(code: u16, reason: &str, causes: Value) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": "refused", "details": {"causes": causes},
        })
    }

    fn success() -> Value {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200})
    }

    fn desired() -> copy::Desired {
        copy::Desired {
            name: "web-dfw".into(),
            namespace: "team".into(),
            object: json!({
                "apiVersion": "networking.datumapis.com/v1alpha",
                "kind": "Network",
                "metadata": {"name": "web-dfw", "namespace": "team",
                             "labels": {"replicator.datumapis.com/location": "dfw"}},
                "spec": {"ipam": {"mode": "Auto"}},
            }),
            status: Some(json!({
                "apiVersion": "networking.datumapis.com/v1alpha",
                "kind": "Network",
                "metadata": {"name": "web-dfw", "namespace": "team"},
                "status": {"ready": true},
            })),
            status_paths: vec![rules::FieldPath::try_from("ready".to_owned()).unwrap()],
            hash: "h".into(),
        }
    }

    fn api(sync: &CellSync) -> Api<DynamicObject> {
        Api::namespaced_with(sync.hub.clone(), "team", &sync.rules[0].resource)
    }

    #[tokio::test]
    async fn a_copy_is_applied_then_its_status_under_the_location_field_manager() {
        let (sync, _writers, _cell, mut hub) = fixture();
        let id: CopyId = (0, "team".into(), "web-dfw".into());
        let write = {
            let (sync, id) = (Arc::clone(&sync), id.clone());
            tokio::spawn(async move { sync.apply_copy(&api(&sync), &id, &desired(), None).await })
        };
        let apply = answer(&mut hub, StatusCode::CREATED, network("web-dfw", "u-1", "11", "dfw")).await;
        assert_eq!(apply.0, Method::PATCH);
        assert_eq!(
            apply.1,
            format!("{COPIES}/web-dfw?&force=true&fieldManager=replicator-dfw")
        );
        assert_eq!(apply.2, "application/apply-patch+yaml");
        assert_eq!(apply.3, desired().object);
        let status_apply = answer(&mut hub, StatusCode::OK, network("web-dfw", "u-1", "12", "dfw")).await;
        assert_eq!(status_apply.0, Method::PATCH);
        assert_eq!(
            status_apply.1,
            format!("{COPIES}/web-dfw/status?&force=true&fieldManager=replicator-dfw")
        );
        assert_eq!(status_apply.3, desired().status.unwrap());
        assert!(!write.await.unwrap().unwrap(), "applied, not replaced");
        let mut echoes = lock(&sync.echoes);
        assert_eq!(echoes.observe(&id, "11"), Seen::Echo, "the apply's echo is awaited");
        assert_eq!(echoes.observe(&id, "12"), Seen::Echo, "the status apply's echo too");
        assert_eq!(echoes.observe(&id, "13"), Seen::Change);
    }

    #[tokio::test]
    async fn an_immutable_field_replaces_the_copy_read_by_its_uid() {
        let (sync, _writers, _cell, mut hub) = fixture();
        let existing: DynamicObject = serde_json::from_value(network("web-dfw", "u-old", "5", "dfw")).unwrap();
        let write = {
            let sync = Arc::clone(&sync);
            tokio::spawn(async move {
                let id = (0, "team".into(), "web-dfw".into());
                let mut d = desired();
                d.status = None;
                sync.apply_copy(&api(&sync), &id, &d, Some(&existing)).await
            })
        };
        let immutable = json!([{"reason": "FieldValueInvalid", "message": "Invalid value: \"IPv6\": field is immutable", "field": "addressType"}]);
        let refused = answer(
            &mut hub,
            StatusCode::UNPROCESSABLE_ENTITY,
            status(422, "Invalid", immutable),
        )
        .await;
        assert_eq!(refused.0, Method::PATCH);
        let delete = answer(&mut hub, StatusCode::OK, success()).await;
        assert_eq!(delete.0, Method::DELETE);
        assert_eq!(delete.1, format!("{COPIES}/web-dfw?"));
        assert_eq!(delete.3["preconditions"], json!({"uid": "u-old"}));
        let create = answer(&mut hub, StatusCode::CREATED, network("web-dfw", "u-new", "6", "dfw")).await;
        assert_eq!(create.0, Method::PATCH);
        assert_eq!(create.3, desired().object);
        assert!(write.await.unwrap().unwrap(), "replaced");
    }

    #[tokio::test]
    async fn another_refusal_of_the_apply_is_the_pass_error_and_nothing_is_deleted() {
        let (sync, _writers, _cell, mut hub) = fixture();
        let existing: DynamicObject = serde_json::from_value(network("web-dfw", "u-old", "5", "dfw")).unwrap();
        let write = {
            let sync = Arc::clone(&sync);
            tokio::spawn(async move {
                let id = (0, "team".into(), "web-dfw".into());
                sync.apply_copy(&api(&sync), &id, &desired(), Some(&existing)).await
            })
        };
        let other = json!([{"reason": "FieldValueRequired", "message": "Required value", "field": "spec.ipam"}]);
        answer(
            &mut hub,
            StatusCode::UNPROCESSABLE_ENTITY,
            status(422, "Invalid", other),
        )
        .await;
        let err = write.await.unwrap().unwrap_err();
        assert!(
            matches!(&err, Error::Hub(kube::Error::Api(s)) if s.code == 422),
            "{err}"
        );
        assert_eq!(err.class(), crate::api_errors::ErrorClass::Invalid);
    }

    #[tokio::test]
    async fn a_withdrawal_deletes_the_cached_copy_by_uid_and_rereads_a_stale_one() {
        let (sync, mut writers, _cell, mut hub) = fixture();
        let cached: DynamicObject = serde_json::from_value(network("web-dfw", "u-stale", "5", "dfw")).unwrap();
        writers.copies[0].apply_watcher_event(&kube::runtime::watcher::Event::Apply(cache::Cached::new(&cached)));
        let withdraw = {
            let sync = Arc::clone(&sync);
            tokio::spawn(async move { sync.withdraw(&sync.rules[0], "team", "web-dfw").await })
        };
        let stale = answer(&mut hub, StatusCode::CONFLICT, status(409, "Conflict", json!([]))).await;
        assert_eq!(
            (stale.0, stale.3["preconditions"].clone()),
            (Method::DELETE, json!({"uid": "u-stale"}))
        );
        let read = answer(
            &mut hub,
            StatusCode::OK,
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                   "metadata": network("web-dfw", "u-now", "9", "dfw")["metadata"]}),
        )
        .await;
        assert_eq!((read.0, read.1), (Method::GET, format!("{COPIES}/web-dfw")));
        let delete = answer(&mut hub, StatusCode::OK, success()).await;
        assert_eq!(
            (delete.0, delete.3["preconditions"].clone()),
            (Method::DELETE, json!({"uid": "u-now"}))
        );
        assert!(withdraw.await.unwrap().unwrap(), "deleted");
    }

    #[tokio::test]
    async fn a_withdrawal_never_deletes_what_is_not_this_locations_copy() {
        let (sync, _writers, _cell, mut hub) = fixture();
        for holder in ["sjc", "gone"] {
            let withdraw = {
                let sync = Arc::clone(&sync);
                tokio::spawn(async move { sync.withdraw(&sync.rules[0], "team", "web-dfw").await })
            };
            let read = if holder == "gone" {
                answer(&mut hub, StatusCode::NOT_FOUND, status(404, "NotFound", json!([]))).await
            } else {
                answer(
                    &mut hub,
                    StatusCode::OK,
                    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                           "metadata": network("web-dfw", "u-sjc", "9", holder)["metadata"]}),
                )
                .await
            };
            assert_eq!(read.0, Method::GET, "no cached copy: read first");
            assert!(!withdraw.await.unwrap().unwrap(), "{holder}: nothing deleted");
        }
    }
}
