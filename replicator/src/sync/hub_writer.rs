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
        lock(&sync.echoes).begin(id.clone());
        Writing { sync, key, id }
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if lock(&self.sync.echoes).end(&self.id) {
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
        lock(&self.echoes).wrote(id, applied.resource_version());
        // A change that leaves the carried status as the copy has it (a label, a spec field)
        // needs no status write.
        let status_current = copy::status_in_sync(desired, existing);
        if let Some(status) = desired.status.as_ref().filter(|_| !status_current) {
            let applied = api
                .patch_status(&desired.name, &params, &Patch::Apply(status))
                .await
                .map_err(Error::Hub)?;
            lock(&self.echoes).wrote(id, applied.resource_version());
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
