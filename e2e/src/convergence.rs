//! Whether the hub holds exactly the copies a location owes it for one namespace: every source
//! in the cell has its correct copy, and no copy of the location lacks a source.
//!
//! "Correct" is the product's own definition: the desired copy is planned with
//! [`replicator::copy::plan`] from the source as the cell holds it now and compared with
//! [`replicator::copy::in_sync`], so a stale copy (an update lost) counts as much as a missing one
//! (a create lost) or an orphan (a delete lost, or a deleted source resurrected).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DynamicObject, ListParams};
use kube::{Api, Client, ResourceExt};
use replicator::copy::{self, Plan};
use replicator::rules::{self, Rule};

use crate::error::{Error, Result};
use crate::wait::{self, Check};

/// How one namespace of one location compares, kind by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Copies owed per kind (sources that plan to a published copy).
    pub expected: BTreeMap<String, usize>,
    /// Owed copies absent on the hub, as `Kind/name`.
    pub missing: Vec<String>,
    /// Copies present but not in sync with their source's desired copy.
    pub stale: Vec<String>,
    /// Copies of the location whose source is gone or no longer a source.
    pub orphans: Vec<String>,
    /// Sources held by their rule (publish nothing, withdraw nothing): either way is right.
    pub held: usize,
}

impl Report {
    /// Whether nothing is missing, stale or orphaned.
    pub fn converged(&self) -> bool {
        self.missing.is_empty() && self.stale.is_empty() && self.orphans.is_empty()
    }

    /// Total copies owed.
    pub fn expected_total(&self) -> usize {
        self.expected.values().sum()
    }

    /// A one-line description with the first few offenders of each kind of divergence.
    pub fn summary(&self) -> String {
        let first = |v: &[String]| {
            let mut s = v.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
            if v.len() > 3 {
                s.push_str(", ...");
            }
            s
        };
        format!(
            "expected {:?}; {} missing [{}], {} stale [{}], {} orphans [{}], {} held",
            self.expected,
            self.missing.len(),
            first(&self.missing),
            self.stale.len(),
            first(&self.stale),
            self.orphans.len(),
            first(&self.orphans),
            self.held
        )
    }
}

/// The rules of the default resource set named `names` (`endpointslices`, `networks`, ...).
///
/// # Errors
/// [`Error::Scenario`] for a name without a default rule.
pub fn default_rules(names: &[&str]) -> Result<Vec<Rule>> {
    let all = rules::default_rules();
    names
        .iter()
        .map(|name| {
            all.iter()
                .find(|r| r.name == *name)
                .cloned()
                .ok_or_else(|| Error::Scenario(format!("no default rule named {name}")))
        })
        .collect()
}

/// Compares `location`'s copies in `namespace` on the hub with the sources of `rules` in the cell.
///
/// # Errors
/// A failed list.
pub async fn compare(cell: &Client, hub: &Client, namespace: &str, location: &str, rules: &[Rule]) -> Result<Report> {
    let mut report = Report::default();
    let ns = Api::<Namespace>::all(cell.clone()).get_opt(namespace).await?;
    let routing = replicator::routing::resolve(namespace, ns.as_ref().map(|n| n.labels()));
    for rule in rules {
        let resource = rule.resource.api_resource();
        let kind = &rule.resource.kind;
        let selector = rules::source_selector(rule).map_err(|e| Error::Scenario(e.to_string()))?;
        let sources = Api::<DynamicObject>::namespaced_with(cell.clone(), namespace, &resource)
            .list(&ListParams::default().labels_from(&selector))
            .await?
            .items;
        let mut owed = BTreeMap::new();
        let mut held = BTreeSet::new();
        if let Ok(routing) = &routing {
            for source in &sources {
                match copy::plan(rule, location, source, routing) {
                    Ok(Plan::Publish(desired)) => {
                        owed.insert(desired.name.clone(), desired);
                    }
                    Ok(Plan::Hold) => {
                        held.insert(copy::copy_name(namespace, &source.name_any(), location));
                    }
                    Ok(Plan::Withdraw | Plan::Ignore) | Err(_) => {}
                }
            }
        }
        let copies = Api::<DynamicObject>::namespaced_with(hub.clone(), namespace, &resource)
            .list(&ListParams::default().labels(&format!("{}={location}", rules::LOCATION_LABEL)))
            .await?
            .items;
        let present: BTreeMap<String, &DynamicObject> = copies.iter().map(|c| (c.name_any(), c)).collect();
        for (name, desired) in &owed {
            match present.get(name) {
                None => report.missing.push(format!("{kind}/{name}")),
                Some(copy) if !copy::in_sync(desired, copy) => report.stale.push(format!("{kind}/{name}")),
                Some(_) => {}
            }
        }
        for name in present.keys() {
            if !owed.contains_key(name) && !held.contains(name) {
                report.orphans.push(format!("{kind}/{name}"));
            }
        }
        report.expected.insert(kind.clone(), owed.len());
        report.held += held.len();
    }
    Ok(report)
}

/// Polls [`compare`] until it reports convergence, and returns that report.
///
/// # Errors
/// [`Error::Timeout`] with the last report's summary.
pub async fn wait_converged(
    cell: &Client,
    hub: &Client,
    namespace: &str,
    location: &str,
    rules: &[Rule],
    deadline: Duration,
) -> Result<Report> {
    let what = format!("location {location}'s copies in {namespace} to match the cell");
    wait::until_observed(deadline, &what, || async {
        let report = compare(cell, hub, namespace, location, rules).await?;
        Ok::<_, Error>(if report.converged() {
            Check::Ready(report)
        } else {
            Check::NotYet(report.summary())
        })
    })
    .await
}
