//! One pass over one key: make the hub copy match the source, or withdraw it.

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, GetParams, ListParams},
    runtime::{events::EventType, reflector::ObjectRef},
};

use super::{
    CellSync, Error, Key, RuleState,
    hub_writer::Writing,
    lock,
    step::{self, Refusal, Start, Write},
};
use crate::{
    cache,
    copy::{self, Plan},
    metrics::WriteOp,
    routing, rules,
};

impl CellSync {
    /// One pass over one key: make the hub copy match the source (or withdraw it). The steps
    /// are decided by the pure planner ([`step::start`], [`copy::plan`], [`step::judge`]); this
    /// carries them out.
    pub(super) async fn process(&self, key: &Key) -> Result<(), Error> {
        let state = &self.rules[key.rule];
        let location = &self.settings.location;
        let copy_name = copy::copy_name(&key.namespace, &key.name, location);
        let ns_key = (key.namespace.clone(), key.name.clone());
        let source = state.sources.get(&cache::key(&key.namespace, &key.name));
        let tombstoned = source.is_none() && lock(&state.tombstones).contains(&ns_key);
        let ns_labels = self
            .namespaces
            .get(&ObjectRef::new(&key.namespace))
            .map(|ns| ns.labels().clone());
        let copy_cached = state.copies.get(&cache::key(&key.namespace, &copy_name)).is_some();
        let start = step::start(
            source.is_some(),
            tombstoned,
            routing::resolve(&key.namespace, ns_labels.as_ref()),
            copy_cached,
        );
        let routing = match start {
            Start::Withdraw => {
                let deleted = self.withdraw(state, &key.namespace, &copy_name).await?;
                lock(&state.tombstones).remove(&ns_key);
                self.set_unroutable(state, key, false);
                if deleted {
                    self.write_done(key, WriteOp::delete);
                } else {
                    lock(&self.first_seen).remove(key);
                }
                return Ok(());
            }
            Start::LeaveToSweep => {
                lock(&self.first_seen).remove(key);
                return Ok(());
            }
            Start::Plan(routing) => {
                self.set_unroutable(state, key, false);
                routing
            }
            Start::ConfirmUnroutable(unroutable) => {
                // A copy published under the old routing must not stay: Karmada would go on
                // delivering it to the old project. Before withdrawing it, confirm with a read of
                // the cell (as the sweep does before deleting).
                match self.read_routing(&key.namespace).await? {
                    Ok(routing) => routing,
                    Err(confirmed) => {
                        self.withdraw_unroutable(state, key, &copy_name, &confirmed).await?;
                        self.report_unroutable(state, key, &unroutable).await;
                        return Ok(());
                    }
                }
            }
            Start::Unroutable(unroutable) => {
                self.report_unroutable(state, key, &unroutable).await;
                return Ok(());
            }
        };
        let Some(source) = source else {
            // `start` plans only a cached source.
            return Ok(());
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
                let existing = self.existing_copy(state, &api, key, &copy_name).await?;
                match step::judge(&desired, existing.as_ref(), location, cell) {
                    Err(Refusal::NotOurs) => Err(self.not_ours(key, &copy_name, existing.as_ref())),
                    Err(Refusal::OtherCell(cell)) => Err(Error::OtherCell {
                        namespace: key.namespace.clone(),
                        name: copy_name,
                        cell,
                    }),
                    Ok(Write::InSync) => {
                        self.write_done(key, WriteOp::skipped);
                        Ok(())
                    }
                    Ok(Write::Apply { exists }) => {
                        let writing = Writing::begin(self, key, copy_name.clone());
                        let replaced = self.apply_copy(&api, &writing.id, &desired, existing.as_ref()).await?;
                        drop(writing);
                        self.write_done(key, step::applied_op(replaced, exists));
                        tracing::debug!(copy = %copy_name, "copy applied");
                        Ok(())
                    }
                }
            }
        }
    }

    /// The object under copy name `copy_name` on the hub, as our cache has it; a copy missing
    /// from it is almost always one to create, but the name may be taken by an object that is
    /// not ours (another location's copy, a hand-made object), which a forced apply would take
    /// over, or be our copy the cache has not listed yet (a restart), which may need no write.
    /// So it is read, from the apiserver's watch cache (`resourceVersion=0`): no etcd round trip
    /// for the hub (issue #5). A name taken in the instant between this read and the apply is
    /// not caught; nor would it be by a quorum read.
    ///
    /// # Errors
    /// [`Error::Cache`] for an unreadable cached copy, [`Error::Hub`] for a failed read.
    async fn existing_copy(
        &self,
        state: &RuleState,
        api: &Api<DynamicObject>,
        key: &Key,
        copy_name: &str,
    ) -> Result<Option<DynamicObject>, Error> {
        match state.copies.get(&cache::key(&key.namespace, copy_name)) {
            Some(copy) => Ok(Some(copy.object().map_err(|e| Error::Cache {
                what: "copy",
                namespace: key.namespace.clone(),
                name: copy_name.to_owned(),
                source: e,
            })?)),
            None => match api.get_with(copy_name, &GetParams::any()).await {
                Ok(copy) => Ok(Some(copy)),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
                Err(e) => Err(Error::Hub(e)),
            },
        }
    }

    /// The error for hub object `existing`, named like the copy of `key`, that is not this
    /// location's copy; when it is another location's copy (`web-us`@`east` and `web`@`us-east`
    /// both map to `web-us-east`), the message names that copy's source and location too.
    fn not_ours(&self, key: &Key, name: &str, existing: Option<&DynamicObject>) -> Error {
        let label = |k: &str| existing.and_then(|e| e.labels().get(k));
        let annotation = |k: &str| existing.and_then(|e| e.annotations().get(k));
        let holder = match (
            label(rules::LOCATION_LABEL),
            annotation(copy::SOURCE_NAMESPACE_ANNOTATION),
            annotation(copy::SOURCE_NAME_ANNOTATION),
        ) {
            (Some(location), Some(namespace), Some(source)) => {
                format!("the copy of source {namespace}/{source} of location {location}")
            }
            (Some(location), _, _) => format!("a copy of location {location}"),
            _ => "an object the replicator did not publish".to_owned(),
        };
        Error::NotOurs {
            namespace: key.namespace.clone(),
            name: name.to_owned(),
            label: rules::LOCATION_LABEL,
            location: self.settings.location.clone(),
            source_key: format!("{}/{}", key.namespace, key.name),
            holder,
        }
    }

    /// Reports that `key` is not published because its namespace is not routable: once per
    /// episode, a warning and an `Unroutable` Event on the source; its lag is not measured.
    async fn report_unroutable(&self, state: &RuleState, key: &Key, unroutable: &routing::Unroutable) {
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
