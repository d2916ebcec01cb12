//! One pass over one key: make the hub copy match the source, or withdraw it.

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, GetParams, ListParams},
    runtime::{events::EventType, reflector::ObjectRef},
};

use super::{CellSync, Error, Key, RuleState, hub_writer::Writing, lock};
use crate::{
    cache,
    copy::{self, Plan},
    metrics::WriteOp,
    routing,
};

impl CellSync {
    /// One pass over one key: make the hub copy match the source (or withdraw it).
    pub(super) async fn process(&self, key: &Key) -> Result<(), Error> {
        let state = &self.rules[key.rule];
        let location = &self.settings.location;
        let copy_name = copy::copy_name(&key.namespace, &key.name, location);
        let ns_key = (key.namespace.clone(), key.name.clone());
        let Some(source) = state.sources.get(&cache::key(&key.namespace, &key.name)) else {
            if lock(&state.tombstones).contains(&ns_key) {
                let deleted = self.withdraw(state, &key.namespace, &copy_name).await?;
                lock(&state.tombstones).remove(&ns_key);
                self.set_unroutable(state, key, false);
                if deleted {
                    self.write_done(key, WriteOp::delete);
                } else {
                    lock(&self.first_seen).remove(key);
                }
            } else {
                // Absent without a watched delete: the sweep decides (it confirms with the cell).
                lock(&self.first_seen).remove(key);
            }
            return Ok(());
        };
        let ns_labels = self
            .namespaces
            .get(&ObjectRef::new(&key.namespace))
            .map(|ns| ns.labels().clone());
        let routing = match routing::resolve(&key.namespace, ns_labels.as_ref()) {
            Ok(routing) => {
                self.set_unroutable(state, key, false);
                routing
            }
            Err(unroutable) => {
                // A copy published under the old routing must not stay: Karmada would go on
                // delivering it to the old project. Before withdrawing it, confirm with a read of
                // the cell (as the sweep does before deleting): a cache behind the cell must not
                // withdraw anything.
                let has_copy = state.copies.get(&cache::key(&key.namespace, &copy_name)).is_some();
                let confirmed = if has_copy {
                    match self.read_routing(&key.namespace).await? {
                        Ok(routing) => Some(routing),
                        Err(confirmed) => {
                            self.withdraw_unroutable(state, key, &copy_name, &confirmed).await?;
                            None
                        }
                    }
                } else {
                    None
                };
                match confirmed {
                    Some(routing) => routing,
                    None => {
                        if self.set_unroutable(state, key, true) {
                            tracing::warn!(reason = %unroutable, "source not published: namespace is not routable");
                            self.publish_event(
                                key,
                                EventType::Warning,
                                "Unroutable",
                                &format!("not published to the hub: {unroutable}"),
                            )
                            .await;
                        }
                        lock(&self.first_seen).remove(key);
                        return Ok(());
                    }
                }
            }
        };
        let source = source.object().map_err(|e| Error::Cache {
            what: "source",
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            source: e,
        })?;
        match copy::plan(&state.rule, location, &source, &routing)? {
            Plan::Ignore | Plan::Hold => {
                lock(&self.first_seen).remove(key);
                Ok(())
            }
            Plan::Withdraw => {
                if self.withdraw(state, &key.namespace, &copy_name).await? {
                    self.write_done(key, WriteOp::delete);
                }
                Ok(())
            }
            Plan::Publish(mut desired) => {
                // The copy watch starts only once the cell is identified, so a listed key has it.
                let Some(cell) = self.cell_id() else {
                    return Err(Error::CellUnidentified);
                };
                copy::mark_cell(&mut desired, cell);
                let api = Api::<DynamicObject>::namespaced_with(self.hub.clone(), &key.namespace, &state.resource);
                // The copy as our cache has it; a copy missing from it is almost always one to
                // create, but the name may be taken by an object that is not ours (another
                // location's copy, a hand-made object), which a forced apply would take over, or
                // be our copy the cache has not listed yet (a restart), which may need no write.
                // So read it first, from the apiserver's watch cache (`resourceVersion=0`): no
                // etcd round trip for the hub (issue #5). A name taken in the instant between
                // this read and the apply is not caught; nor would it be by a quorum read.
                let existing = match state.copies.get(&cache::key(&key.namespace, &copy_name)) {
                    Some(copy) => Some(copy.object().map_err(|e| Error::Cache {
                        what: "copy",
                        namespace: key.namespace.clone(),
                        name: copy_name.clone(),
                        source: e,
                    })?),
                    None => match api.get_with(&copy_name, &GetParams::any()).await {
                        Ok(copy) => Some(copy),
                        Err(kube::Error::Api(s)) if s.code == 404 => None,
                        Err(e) => return Err(Error::Hub(e)),
                    },
                };
                if let Some(copy) = &existing {
                    if !copy::published_by(copy, location) {
                        return Err(self.not_ours(key, &copy_name, copy));
                    }
                    if let Some(other) = copy::publishing_cell(copy).filter(|c| *c != cell) {
                        return Err(Error::OtherCell {
                            namespace: key.namespace.clone(),
                            name: copy_name,
                            cell: other.to_owned(),
                        });
                    }
                    if copy::in_sync(&desired, copy) {
                        self.write_done(key, WriteOp::skipped);
                        return Ok(());
                    }
                }
                let writing = Writing::begin(self, key, copy_name.clone());
                let replaced = self.apply_copy(&api, &writing.id, &desired, existing.as_ref()).await?;
                drop(writing);
                self.write_done(
                    key,
                    match (replaced, existing.is_some()) {
                        (true, _) => WriteOp::replace,
                        (false, true) => WriteOp::update,
                        (false, false) => WriteOp::create,
                    },
                );
                tracing::debug!(copy = %copy_name, "copy applied");
                Ok(())
            }
        }
    }

    /// The routing of `namespace` as the cell has it now: a consistent LIST of that one
    /// namespace (the role's `list`, no `get` needed), not the cache.
    ///
    /// # Errors
    /// [`Error::Cell`] when the cell cannot be read; the caller keeps the copy.
    pub(super) async fn read_routing(
        &self,
        namespace: &str,
    ) -> Result<Result<routing::Routing, routing::Unroutable>, Error> {
        let api = Api::<Namespace>::all(self.cell.clone());
        let params = ListParams::default().fields(&format!("metadata.name={namespace}"));
        let listed = api.list_metadata(&params).await.map_err(Error::Cell)?;
        let labels = listed.items.first().map(|ns| ns.labels().clone());
        Ok(routing::resolve(namespace, labels.as_ref()))
    }

    /// Withdraws the copy of `key` because its namespace is no longer routable (`why`, confirmed
    /// with the cell): the copy is deleted (UID precondition), the source gets a `Withdrawn`
    /// Event and the delete is counted as a write.
    pub(super) async fn withdraw_unroutable(
        &self,
        state: &RuleState,
        key: &Key,
        copy_name: &str,
        why: &routing::Unroutable,
    ) -> Result<(), Error> {
        if self.withdraw(state, &key.namespace, copy_name).await? {
            tracing::warn!(copy = %copy_name, reason = %why, "copy withdrawn: its namespace is no longer routable");
            self.publish_event(
                key,
                EventType::Warning,
                "Withdrawn",
                &format!("copy {}/{copy_name} withdrawn from the hub: {why}", key.namespace),
            )
            .await;
            self.write_done(key, WriteOp::delete);
        }
        Ok(())
    }

    /// Records whether `key` is unroutable; returns true when it just became unroutable.
    pub(super) fn set_unroutable(&self, state: &RuleState, key: &Key, unroutable: bool) -> bool {
        let mut set = lock(&state.unroutable);
        let id = (key.namespace.clone(), key.name.clone());
        let changed = if unroutable { set.insert(id) } else { set.remove(&id) };
        if changed {
            self.metrics
                .unroutable
                .get_or_create(&state.labels)
                .set(set.len() as i64);
        }
        changed && unroutable
    }
}
