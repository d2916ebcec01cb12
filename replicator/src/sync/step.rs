//! The pure planner of a pass: from what the caches hold about one key to the step the pass
//! takes, and from the copy on the hub to the write it needs. No I/O; the pass (`pass.rs`)
//! carries the steps out and the hub writer (`hub_writer.rs`) makes the writes.

use kube::api::DynamicObject;

use crate::{
    copy::{self, Desired},
    metrics::WriteOp,
    routing::{Routing, Unroutable},
};

/// What a pass does first about one key, decided from the caches alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// The source is gone and its delete was watched (a tombstone): withdraw the copy.
    Withdraw,
    /// The source is absent without a watched delete: nothing now; the sweep decides, after
    /// confirming with the cell.
    LeaveToSweep,
    /// The source's namespace is not routable but a copy is published (under an earlier
    /// routing): confirm with a read of the cell's namespace before withdrawing it, since a
    /// cache behind the cell must not withdraw anything.
    ConfirmUnroutable(Unroutable),
    /// The namespace is not routable and no copy is published: report it, publish nothing.
    Unroutable(Unroutable),
    /// The namespace routes to `Routing`: plan the copy.
    Plan(Routing),
}

/// The first step for a key: `source_cached` whether the cell cache holds the source,
/// `tombstoned` whether its delete was watched, `routing` its namespace's routing as the cache
/// resolves it ([`crate::routing::resolve`]), `copy_cached` whether the hub cache holds this
/// location's copy.
pub fn start(source_cached: bool, tombstoned: bool, routing: Result<Routing, Unroutable>, copy_cached: bool) -> Start {
    if !source_cached {
        return if tombstoned {
            Start::Withdraw
        } else {
            Start::LeaveToSweep
        };
    }
    match routing {
        Ok(routing) => Start::Plan(routing),
        Err(unroutable) if copy_cached => Start::ConfirmUnroutable(unroutable),
        Err(unroutable) => Start::Unroutable(unroutable),
    }
}

/// What the copy on the hub needs, given the desired copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// The copy already carries everything desired ([`copy::in_sync`]): no write.
    InSync,
    /// Apply the desired copy (and its status); `exists` whether a copy is there already.
    Apply {
        /// A copy of ours exists (an update); otherwise a create.
        exists: bool,
    },
}

/// Why a write to the object under the copy's name is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The object does not carry this location's label: another location's copy or an object
    /// the replicator did not publish. Never modified.
    NotOurs,
    /// This location's copy, published by another cell (its `kube-system` UID): one cell per
    /// location, so never modified.
    OtherCell(String),
}

/// Judges the object `existing` under the copy's name (`None`: nothing there) against
/// `desired`, for location `location` in cell `cell` (docs/architecture.md: a replicator
/// writes only its own location's copies from its own cell).
///
/// # Errors
/// [`Refusal`] when the object is not this location's copy from this cell.
pub fn judge(
    desired: &Desired,
    existing: Option<&DynamicObject>,
    location: &str,
    cell: &str,
) -> Result<Write, Refusal> {
    let Some(existing) = existing else {
        return Ok(Write::Apply { exists: false });
    };
    if !copy::published_by(existing, location) {
        return Err(Refusal::NotOurs);
    }
    if let Some(other) = copy::publishing_cell(existing).filter(|c| *c != cell) {
        return Err(Refusal::OtherCell(other.to_owned()));
    }
    if copy::in_sync(desired, existing) {
        Ok(Write::InSync)
    } else {
        Ok(Write::Apply { exists: true })
    }
}

/// The write metric's `op` of an apply: `replace` when an immutable field forced a delete and
/// create, `update` over an existing copy, `create` otherwise.
pub fn applied_op(replaced: bool, existed: bool) -> WriteOp {
    match (replaced, existed) {
        (true, _) => WriteOp::replace,
        (false, true) => WriteOp::update,
        (false, false) => WriteOp::create,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    fn routing() -> Routing {
        Routing {
            upstream_cluster_name: "cluster-p".into(),
            upstream_namespace: "ns-p".into(),
        }
    }

    fn unknown() -> Unroutable {
        Unroutable::NamespaceUnknown("team".into())
    }

    #[test]
    fn start_decides_each_branch() {
        let cases = [
            // (source cached, tombstoned, routable, copy cached) -> step
            ((false, true, true, true), Start::Withdraw),
            ((false, true, false, false), Start::Withdraw),
            ((false, false, true, true), Start::LeaveToSweep),
            ((false, false, false, false), Start::LeaveToSweep),
            ((true, false, true, false), Start::Plan(routing())),
            ((true, true, true, true), Start::Plan(routing())),
            ((true, false, false, true), Start::ConfirmUnroutable(unknown())),
            ((true, false, false, false), Start::Unroutable(unknown())),
        ];
        for ((source, tomb, routable, copy), want) in cases {
            let r = if routable { Ok(routing()) } else { Err(unknown()) };
            assert_eq!(start(source, tomb, r, copy), want, "{source} {tomb} {routable} {copy}");
        }
    }

    const HASH: &str = "0123456789abcdef0123456789abcdef";

    fn desired() -> Desired {
        Desired {
            name: "web-dfw".into(),
            namespace: "team".into(),
            object: json!({
                "apiVersion": "networking.datumapis.com/v1alpha",
                "kind": "Network",
                "metadata": {
                    "name": "web-dfw",
                    "namespace": "team",
                    "labels": {"replicator.datumapis.com/location": "dfw"},
                    "annotations": {"replicator.datumapis.com/content-hash": HASH},
                },
                "spec": {"ipam": {"mode": "Auto"}},
            }),
            status: None,
            status_paths: Vec::new(),
            hash: HASH.into(),
        }
    }

    /// A hub object named like the copy, with these labels, annotations and spec.
    fn existing(labels: &[(&str, &str)], annotations: &[(&str, &str)], spec: serde_json::Value) -> DynamicObject {
        let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        serde_json::from_value(json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "Network",
            "metadata": {
                "name": "web-dfw",
                "namespace": "team",
                "labels": map(labels),
                "annotations": map(annotations),
            },
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn judge_refuses_what_is_not_ours_and_skips_what_is_in_sync() {
        let d = desired();
        let ours = [("replicator.datumapis.com/location", "dfw")];
        let hash = ("replicator.datumapis.com/content-hash", HASH);
        let spec = json!({"ipam": {"mode": "Auto"}});
        assert_eq!(judge(&d, None, "dfw", "cell-1"), Ok(Write::Apply { exists: false }));
        let hand_made = existing(&[], &[], spec.clone());
        assert_eq!(judge(&d, Some(&hand_made), "dfw", "cell-1"), Err(Refusal::NotOurs));
        let other_location = existing(&[("replicator.datumapis.com/location", "sjc")], &[hash], spec.clone());
        assert_eq!(judge(&d, Some(&other_location), "dfw", "cell-1"), Err(Refusal::NotOurs));
        let other_cell = existing(
            &ours,
            &[hash, ("replicator.datumapis.com/cell", "cell-2")],
            spec.clone(),
        );
        assert_eq!(
            judge(&d, Some(&other_cell), "dfw", "cell-1"),
            Err(Refusal::OtherCell("cell-2".into()))
        );
        let same = existing(
            &ours,
            &[hash, ("replicator.datumapis.com/cell", "cell-1")],
            spec.clone(),
        );
        assert_eq!(judge(&d, Some(&same), "dfw", "cell-1"), Ok(Write::InSync));
        // A copy written before cells were recorded is ours; in sync when its content is.
        let unrecorded = existing(&ours, &[hash], spec.clone());
        assert_eq!(judge(&d, Some(&unrecorded), "dfw", "cell-1"), Ok(Write::InSync));
        let stale_hash = existing(&ours, &[("replicator.datumapis.com/content-hash", "old")], spec);
        assert_eq!(
            judge(&d, Some(&stale_hash), "dfw", "cell-1"),
            Ok(Write::Apply { exists: true })
        );
        let edited = existing(&ours, &[hash], json!({"ipam": {"mode": "Manual"}}));
        assert_eq!(
            judge(&d, Some(&edited), "dfw", "cell-1"),
            Ok(Write::Apply { exists: true })
        );
    }

    #[test]
    fn applied_op_names_the_write() {
        assert_eq!(applied_op(false, false), WriteOp::create);
        assert_eq!(applied_op(false, true), WriteOp::update);
        assert_eq!(applied_op(true, true), WriteOp::replace);
        assert_eq!(applied_op(true, false), WriteOp::replace);
    }
}
