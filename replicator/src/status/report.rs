//! The pure part of `replicator status`: what was listed and scraped → one row per location and
//! kind. No I/O and no clock (the time is an input).
//!
//! Drift is judged exactly as the replicator judges it: for each source the copy
//! [`copy::plan`] would produce now is compared with the hub copy by [`copy::in_sync`] (the
//! fields the replicator owns, docs/architecture.md); copies are matched to sources by [`copy::copy_name`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::jiff::Timestamp;
use kube::{ResourceExt, api::DynamicObject};
use serde::Serialize;

use super::exposition::{self, Sample};
use crate::{
    copy::{self, Plan},
    routing,
    rules::{self, Rule},
};

/// Metric of the propagation lag histogram (docs/architecture.md).
pub const LAG_METRIC: &str = "replicator_propagation_lag_seconds";
/// Gauge of the last successful write or verified no-op, Unix seconds (docs/architecture.md).
pub const LAST_SYNC_METRIC: &str = "replicator_last_sync_timestamp_seconds";
/// Gauge, 1 while a process is the writer of its location (docs/architecture.md).
pub const LEADER_METRIC: &str = "replicator_leader";

/// What was read from one cell: its namespaces' labels and, per rule (same order as the rules),
/// the sources or the error listing them.
#[derive(Clone, Debug, Default)]
pub struct CellListing {
    /// Namespace name → labels (for project routing).
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Per rule: the objects matching the rule's source selector, or why they could not be listed.
    pub sources: Vec<Result<Vec<DynamicObject>, String>>,
}

/// One `--cell LOCATION=KUBECONFIG`: the listing, or why the cell could not be read at all.
#[derive(Clone, Debug)]
pub struct CellInput {
    /// The location the cell publishes as.
    pub location: String,
    /// What was listed.
    pub read: Result<CellListing, String>,
}

/// One `--metrics [LOCATION=]URL`: the samples, or why the endpoint could not be scraped.
#[derive(Clone, Debug)]
pub struct MetricsInput {
    /// The URL scraped.
    pub url: String,
    /// The location it was given for, if any (needed to show a failed scrape in that location's rows).
    pub location: Option<String>,
    /// The samples.
    pub samples: Result<Vec<Sample>, String>,
}

/// Everything [`build`] needs.
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    /// The rules in force (`--rules` applied), one row per location and rule.
    pub rules: &'a [Rule],
    /// Per rule (same order): the hub objects carrying the location label, or the listing error.
    pub hub: Vec<Result<Vec<DynamicObject>, String>>,
    /// The cells given.
    pub cells: Vec<CellInput>,
    /// The metrics endpoints given.
    pub metrics: Vec<MetricsInput>,
    /// The namespace the listings were limited to, if any (shown in the report).
    pub namespace: Option<String>,
    /// The time the report is made at.
    pub now: Timestamp,
}

/// Whether a cell or a metrics endpoint contributed to a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reach {
    /// Read.
    Ok,
    /// None was given for this location.
    NotGiven,
    /// Given, but it could not be read at all (see the row's errors).
    Unreachable,
    /// Read, but this kind could not be listed (see the row's errors).
    Error,
}

/// How a location's copies of a kind compare with its cell's sources.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Drift {
    /// Copies equal to what the replicator would write now.
    pub in_sync: usize,
    /// Copies differing from it on a field the replicator owns (an edit on the hub, or a source
    /// change not yet propagated).
    pub drifted: usize,
    /// Copies without a source (deleted, or no longer selected, in the cell).
    pub orphans: usize,
    /// Sources the replicator would publish that have no copy.
    pub missing: usize,
    /// Sources on hold (e.g. a galactic slice with zero endpoints): nothing published, nothing
    /// withdrawn.
    pub held: usize,
    /// Sources whose namespace lacks the routing labels: not published.
    pub unroutable: usize,
    /// Sources that cannot be turned into a copy (e.g. an invalid label value).
    pub invalid: usize,
}

impl Drift {
    /// Drifted, orphaned and missing copies: what the replicator has yet to repair.
    pub fn total(&self) -> usize {
        self.drifted + self.orphans + self.missing
    }
}

/// Propagation lag percentiles, in seconds, since the scraped processes started.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Lag {
    /// Observations (hub writes acknowledged).
    pub count: u64,
    /// Median, seconds.
    pub p50: Option<f64>,
    /// 95th percentile, seconds.
    pub p95: Option<f64>,
    /// 99th percentile, seconds.
    pub p99: Option<f64>,
}

/// One location and kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// The publishing location (the copies' `replicator.datumapis.com/location`).
    pub location: String,
    /// The kind.
    pub kind: String,
    /// Copies on the hub; `None` when the hub listing of the kind failed.
    pub copies: Option<usize>,
    /// Sources in the cell; `None` when no cell was given or it could not be listed.
    pub sources: Option<usize>,
    /// Comparison of the two; `None` unless both were listed.
    pub drift: Option<Drift>,
    /// Newest write of the location's field manager on these copies (managedFields), RFC 3339.
    pub last_write: Option<String>,
    /// `replicator_last_sync_timestamp_seconds` (last write or verified no-op), RFC 3339.
    pub last_sync: Option<String>,
    /// Percentiles from `replicator_propagation_lag_seconds`.
    pub lag: Option<Lag>,
    /// Whether a scraped process reports `replicator_leader` 1 for the location; `None` when
    /// none reports the gauge.
    pub leader: Option<bool>,
    /// Whether the cell was read.
    pub cell: Reach,
    /// Whether metrics for the location were scraped.
    pub metrics: Reach,
    /// What could not be read for this row.
    pub errors: Vec<String>,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// When it was made, RFC 3339.
    pub generated_at: String,
    /// The namespace it is limited to, if any (metrics are never limited).
    pub namespace: Option<String>,
    /// One row per location and kind, locations sorted, kinds in rule order.
    pub rows: Vec<Row>,
    /// Inputs that failed without a row to show them in (a metrics URL given without location).
    pub problems: Vec<String>,
}

/// The location a copy was published by (its location label).
fn location_of(copy: &DynamicObject) -> Option<&str> {
    copy.labels().get(rules::LOCATION_LABEL).map(String::as_str)
}

/// Newest time among `manager`'s managedFields entries of `objects`.
fn last_write<'a>(objects: impl Iterator<Item = &'a DynamicObject>, manager: &str) -> Option<Timestamp> {
    objects
        .flat_map(|o| o.metadata.managed_fields.iter().flatten())
        .filter(|entry| entry.manager.as_deref() == Some(manager))
        .filter_map(|entry| entry.time.as_ref().map(|t| t.0))
        .max()
}

/// Classifies one location's sources and copies of one kind (all in the given lists).
///
/// Each source is planned with [`copy::plan`] under the routing of its namespace: a plan error
/// counts as invalid, a namespace without routing labels as unroutable, a hold as held (none of
/// them makes its copy an orphan: the replicator leaves such copies alone); a publish plan is
/// in sync, drifted ([`copy::in_sync`] false) or missing (no copy of that name). Objects that are
/// copies or outside the rule's selector are not sources. Copies matched to no source are orphans.
/// Returns the number of sources and the drift.
pub fn classify(
    rule: &Rule,
    location: &str,
    sources: &[DynamicObject],
    copies: &[&DynamicObject],
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
) -> (usize, Drift) {
    let by_name: HashMap<(String, String), &DynamicObject> = copies
        .iter()
        .map(|c| ((c.namespace().unwrap_or_default(), c.name_any()), *c))
        .collect();
    let mut matched: BTreeSet<(String, String)> = BTreeSet::new();
    let mut drift = Drift::default();
    let mut count = 0;
    for source in sources {
        let namespace = source.namespace().unwrap_or_default();
        let copy_key = (
            namespace.clone(),
            copy::copy_name(&namespace, &source.name_any(), location),
        );
        let copy = by_name.get(&copy_key).copied();
        let routing = match routing::resolve(&namespace, namespaces.get(&namespace)) {
            Ok(routing) => routing,
            Err(_) => {
                count += 1;
                drift.unroutable += 1;
                matched.insert(copy_key);
                continue;
            }
        };
        match copy::plan(rule, location, source, &routing) {
            Err(_) => drift.invalid += 1,
            Ok(Plan::Ignore | Plan::Withdraw) => continue,
            Ok(Plan::Hold) => drift.held += 1,
            Ok(Plan::Publish(desired)) => match copy {
                None => drift.missing += 1,
                Some(copy) if copy::in_sync(&desired, copy) => drift.in_sync += 1,
                Some(_) => drift.drifted += 1,
            },
        }
        count += 1;
        matched.insert(copy_key);
    }
    drift.orphans = by_name.keys().filter(|k| !matched.contains(*k)).count();
    (count, drift)
}

fn rfc3339(t: Timestamp) -> String {
    t.to_string()
}

fn unix_to_timestamp(seconds: f64) -> Option<Timestamp> {
    if !seconds.is_finite() || seconds <= 0.0 {
        return None;
    }
    let whole = seconds.trunc();
    // Whole seconds fit i64 for any time a gauge can plausibly hold; out of range is None.
    let nanos = ((seconds - whole) * 1e9).round();
    Timestamp::new(whole as i64, nanos as i32).ok()
}

/// Builds the report: one row per location (every location seen on copies, given as a cell,
/// given with a metrics URL or named in scraped metrics) and rule.
pub fn build(inputs: &Inputs<'_>) -> Report {
    let mut locations: BTreeSet<String> = BTreeSet::new();
    for copies in inputs.hub.iter().flatten() {
        locations.extend(copies.iter().filter_map(location_of).map(str::to_owned));
    }
    locations.extend(inputs.cells.iter().map(|c| c.location.clone()));
    locations.extend(inputs.metrics.iter().filter_map(|m| m.location.clone()));
    let scraped: Vec<(&MetricsInput, &Vec<Sample>)> = inputs
        .metrics
        .iter()
        .filter_map(|m| m.samples.as_ref().ok().map(|s| (m, s)))
        .collect();
    for (_, samples) in &scraped {
        locations.extend(
            samples
                .iter()
                .filter(|s| s.name.starts_with("replicator_"))
                .filter_map(|s| s.label("location"))
                .map(str::to_owned),
        );
    }
    let problems = inputs
        .metrics
        .iter()
        .filter(|m| m.location.is_none())
        .filter_map(|m| m.samples.as_ref().err().map(|e| format!("metrics {}: {e}", m.url)))
        .collect();

    let mut rows = Vec::new();
    for location in &locations {
        let cell = inputs.cells.iter().find(|c| &c.location == location);
        // Scrapes for this location: given for it, or naming it in their series.
        let own: Vec<&MetricsInput> = inputs
            .metrics
            .iter()
            .filter(|m| {
                m.location.as_deref() == Some(location.as_str())
                    || m.samples.as_ref().is_ok_and(|s| {
                        s.iter()
                            .any(|s| s.name.starts_with("replicator_") && s.label("location") == Some(location))
                    })
            })
            .collect();
        let samples: Vec<Sample> = own
            .iter()
            .filter_map(|m| m.samples.as_ref().ok())
            .flatten()
            .cloned()
            .collect();
        let metrics_reach = if own.is_empty() {
            Reach::NotGiven
        } else if own.iter().any(|m| m.samples.is_ok()) {
            Reach::Ok
        } else {
            Reach::Unreachable
        };
        let metrics_errors: Vec<String> = own
            .iter()
            .filter_map(|m| m.samples.as_ref().err().map(|e| format!("metrics {}: {e}", m.url)))
            .collect();
        let leader_values: Vec<f64> = samples
            .iter()
            .filter(|s| s.name == LEADER_METRIC && s.label("location") == Some(location))
            .map(|s| s.value)
            .collect();
        let leader = (!leader_values.is_empty()).then(|| leader_values.contains(&1.0));

        for (i, rule) in inputs.rules.iter().enumerate() {
            let kind = &rule.resource.kind;
            let mut errors = Vec::new();
            let copies: Option<Vec<&DynamicObject>> = match inputs.hub.get(i) {
                Some(Ok(all)) => Some(all.iter().filter(|c| location_of(c) == Some(location)).collect()),
                Some(Err(e)) => {
                    errors.push(format!("hub: listing {kind}: {e}"));
                    None
                }
                None => None,
            };
            let (cell_reach, cell_sources) = match cell.map(|c| &c.read) {
                None => (Reach::NotGiven, None),
                Some(Err(e)) => {
                    errors.push(format!("cell {location}: {e}"));
                    (Reach::Unreachable, None)
                }
                Some(Ok(listing)) => match listing.sources.get(i) {
                    Some(Ok(sources)) => (Reach::Ok, Some((sources, &listing.namespaces))),
                    Some(Err(e)) => {
                        errors.push(format!("cell {location}: listing {kind}: {e}"));
                        (Reach::Error, None)
                    }
                    None => (Reach::Error, None),
                },
            };
            errors.extend(metrics_errors.iter().cloned());
            let classified = match (&cell_sources, &copies) {
                (Some((sources, namespaces)), Some(copies)) => {
                    Some(classify(rule, location, sources, copies, namespaces))
                }
                _ => None,
            };
            let sources = match (&classified, &cell_sources) {
                (Some((count, _)), _) => Some(*count),
                // The hub failed: still count what the replicator would consider sources.
                (None, Some((sources, _))) => Some(sources.iter().filter(|s| !copy::is_copy(s.labels())).count()),
                _ => None,
            };
            let manager = format!("replicator-{location}");
            let selector = [("kind", kind.as_str()), ("location", location.as_str())];
            let histogram = exposition::buckets(&samples, LAG_METRIC, &selector);
            let lag = histogram.last().map(|inf| Lag {
                count: inf.count.max(0.0) as u64,
                p50: exposition::quantile(0.5, &histogram),
                p95: exposition::quantile(0.95, &histogram),
                p99: exposition::quantile(0.99, &histogram),
            });
            let last_sync = samples
                .iter()
                .filter(|s| s.name == LAST_SYNC_METRIC && selector.iter().all(|(k, v)| s.label(k) == Some(*v)))
                .map(|s| s.value)
                .filter(|v| v.is_finite())
                .reduce(f64::max)
                .and_then(unix_to_timestamp);
            rows.push(Row {
                location: location.clone(),
                kind: kind.clone(),
                copies: copies.as_ref().map(Vec::len),
                sources,
                drift: classified.map(|(_, d)| d),
                last_write: copies
                    .as_ref()
                    .and_then(|c| last_write(c.iter().copied(), &manager))
                    .map(rfc3339),
                last_sync: last_sync.map(rfc3339),
                lag,
                leader,
                cell: cell_reach,
                metrics: metrics_reach,
                errors,
            });
        }
    }
    Report {
        generated_at: rfc3339(inputs.now),
        namespace: inputs.namespace.clone(),
        rows,
        problems,
    }
}

/// Seconds as a short duration: `850µs`, `12ms`, `1.5s`, `2m`, `3h`, `4d`.
pub fn short_seconds(s: f64) -> String {
    if !s.is_finite() || s < 0.0 {
        return "-".into();
    }
    match s {
        s if s < 0.001 => format!("{:.0}µs", s * 1e6),
        s if s < 1.0 => format!("{:.0}ms", s * 1e3),
        s if s < 10.0 => format!("{s:.1}s"),
        s if s < 120.0 => format!("{s:.0}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s if s < 172_800.0 => format!("{:.0}h", s / 3600.0),
        s => format!("{:.0}d", s / 86400.0),
    }
}

fn age(now: Timestamp, then: Option<&String>) -> String {
    then.and_then(|t| t.parse::<Timestamp>().ok())
        .map(|t| {
            let seconds = now.duration_since(t).as_secs_f64().max(0.0).floor();
            if seconds < 120.0 {
                format!("{seconds}s ago")
            } else {
                format!("{} ago", short_seconds(seconds))
            }
        })
        .unwrap_or_else(|| "-".into())
}

fn count(n: Option<usize>, reach: Reach) -> String {
    match (n, reach) {
        (Some(n), _) => n.to_string(),
        (None, Reach::Unreachable) => "unreachable".into(),
        (None, Reach::Error) => "error".into(),
        (None, _) => "-".into(),
    }
}

/// Renders the report as an aligned table, then the problems; times as ages relative to the
/// report's own time.
pub fn table(report: &Report) -> String {
    let now = report
        .generated_at
        .parse::<Timestamp>()
        .unwrap_or(Timestamp::UNIX_EPOCH);
    let header = [
        "LOCATION",
        "KIND",
        "COPIES",
        "SOURCES",
        "IN-SYNC",
        "DRIFTED",
        "ORPHANS",
        "MISSING",
        "LAST WRITE",
        "LAST SYNC",
        "LAG P50",
        "P95",
        "P99",
        "LEADER",
        "NOTES",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|h| (*h).to_owned()).collect()];
    for row in &report.rows {
        let drift = |f: fn(&Drift) -> usize| row.drift.as_ref().map_or("-".into(), |d| f(d).to_string());
        let lag = |f: fn(&Lag) -> Option<f64>| row.lag.as_ref().and_then(f).map_or("-".into(), short_seconds);
        let mut notes = Vec::new();
        if let Some(d) = &row.drift {
            for (n, what) in [(d.held, "held"), (d.unroutable, "unroutable"), (d.invalid, "invalid")] {
                if n > 0 {
                    notes.push(format!("{n} {what}"));
                }
            }
        }
        match row.metrics {
            Reach::Unreachable => notes.push("metrics unreachable".into()),
            Reach::Error => notes.push("metrics error".into()),
            Reach::Ok | Reach::NotGiven => {}
        }
        if row.copies.is_none() {
            notes.push("hub listing failed".into());
        }
        lines.push(vec![
            row.location.clone(),
            row.kind.clone(),
            count(row.copies, Reach::Error),
            count(row.sources, row.cell),
            drift(|d| d.in_sync),
            drift(|d| d.drifted),
            drift(|d| d.orphans),
            drift(|d| d.missing),
            age(now, row.last_write.as_ref()),
            age(now, row.last_sync.as_ref()),
            lag(|l| l.p50),
            lag(|l| l.p95),
            lag(|l| l.p99),
            row.leader
                .map_or("-".into(), |l| if l { "yes".into() } else { "no".into() }),
            notes.join(", "),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| lines.iter().map(|l| l[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    let mut errors: Vec<&String> = report.rows.iter().flat_map(|r| &r.errors).collect();
    errors.extend(&report.problems);
    let mut seen = BTreeSet::new();
    errors.retain(|e| seen.insert(*e));
    if !errors.is_empty() {
        out.push_str("\nproblems:\n");
        for e in errors {
            out.push_str(&format!("  {e}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{rules::default_rules, status::exposition::parse};
    use serde_json::{Value, json};

    fn rule(name: &str) -> Rule {
        default_rules().into_iter().find(|r| r.name == name).unwrap()
    }

    fn obj(v: Value) -> DynamicObject {
        serde_json::from_value(v).unwrap()
    }

    fn routed() -> BTreeMap<String, BTreeMap<String, String>> {
        let labels: BTreeMap<String, String> = [
            (routing::UPSTREAM_CLUSTER_LABEL, "cluster-acme_web"),
            (routing::UPSTREAM_NAMESPACE_LABEL, "default"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        [("ns".to_owned(), labels), ("bare".to_owned(), BTreeMap::new())].into()
    }

    fn network(namespace: &str, name: &str, mtu: u32) -> DynamicObject {
        obj(json!({
            "apiVersion": "networking.datumapis.com/v1alpha", "kind": "Network",
            "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}")},
            "spec": {"mtu": mtu}
        }))
    }

    /// The copy the replicator would write for `source`, as the hub would list it.
    fn copy_of(source: &DynamicObject, location: &str, manager_time: &str) -> DynamicObject {
        let routing = routing::resolve("ns", routed().get("ns")).unwrap();
        let Plan::Publish(d) = copy::plan(&rule("networks"), location, source, &routing).unwrap() else {
            panic!("not published")
        };
        let mut v = d.object;
        v["metadata"]["managedFields"] = json!([
            {"manager": format!("replicator-{location}"), "operation": "Apply", "time": manager_time},
            {"manager": "karmada-controller-manager", "operation": "Update", "time": "2030-01-01T00:00:00Z"}
        ]);
        v["metadata"]["labels"]["propagationpolicy.karmada.io/name"] = json!("p");
        obj(v)
    }

    #[test]
    fn every_source_and_copy_is_classified_once() {
        let r = rule("networks");
        let synced = network("ns", "synced", 1460);
        let edited_source = network("ns", "edited", 1460);
        let mut edited = serde_json::to_value(copy_of(&edited_source, "dfw", "2026-01-01T00:00:00Z")).unwrap();
        edited["spec"]["mtu"] = json!(9000);
        let edited = obj(edited);
        let changed_source = network("ns", "changed", 9000);
        let changed = copy_of(&network("ns", "changed", 1460), "dfw", "2026-01-01T00:00:00Z");
        let missing = network("ns", "missing", 1460);
        let unroutable = network("bare", "loose", 1460);
        let unknown_ns = network("gone", "lost", 1460);
        let orphan = copy_of(&network("ns", "deleted", 1460), "dfw", "2026-01-01T00:00:00Z");
        let synced_copy = copy_of(&synced, "dfw", "2026-01-01T00:00:00Z");
        // A copy in the cell (delivered back by Karmada) is never a source.
        let mut delivered = serde_json::to_value(network("ns", "delivered", 1)).unwrap();
        delivered["metadata"]["labels"] = json!({"karmada.io/managed": "true"});
        let sources = vec![
            synced.clone(),
            edited_source,
            changed_source,
            missing,
            unroutable,
            unknown_ns,
            obj(delivered),
        ];
        let copies = vec![&synced_copy, &edited, &changed, &orphan];
        let (count, drift) = classify(&r, "dfw", &sources, &copies, &routed());
        assert_eq!(count, 6);
        assert_eq!(
            drift,
            Drift {
                in_sync: 1,
                drifted: 2,
                orphans: 1,
                missing: 1,
                held: 0,
                unroutable: 2,
                invalid: 0,
            }
        );
        assert_eq!(drift.total(), 4);
    }

    #[test]
    fn held_invalid_and_deselected_sources() {
        let slices = rule("endpointslices");
        let slice = |name: &str, endpoints: Value, tenant: bool| {
            let labels = if tenant {
                json!({"galactic.datum.net/tenant-id": "t"})
            } else {
                json!({})
            };
            obj(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": "ns", "labels": labels},
                "addressType": "IPv6", "endpoints": endpoints
            }))
        };
        let held = slice("empty", json!([]), true);
        // A held slice keeps its copy (nothing withdrawn): not an orphan.
        let mut held_copy =
            serde_json::to_value(slice("empty-dfw", json!([{"addresses": ["fd00::1"]}]), true)).unwrap();
        held_copy["metadata"]["labels"][rules::LOCATION_LABEL] = json!("dfw");
        let held_copy = obj(held_copy);
        // A slice that lost its tenant label is no longer a source: its copy is an orphan.
        let deselected = slice("untagged", json!([{"addresses": ["fd00::2"]}]), false);
        let mut deselected_copy = serde_json::to_value(slice("untagged-dfw", json!([]), true)).unwrap();
        deselected_copy["metadata"]["labels"][rules::LOCATION_LABEL] = json!("dfw");
        let deselected_copy = obj(deselected_copy);
        let (count, drift) = classify(
            &slices,
            "dfw",
            &[held, deselected],
            &[&held_copy, &deselected_copy],
            &routed(),
        );
        assert_eq!(count, 1);
        assert_eq!((drift.held, drift.orphans, drift.missing), (1, 1, 0));

        let interfaces = rule("networkinterfaces");
        let invalid = obj(json!({
            "apiVersion": "networking.datumapis.com/v1alpha", "kind": "NetworkInterface",
            "metadata": {"name": "bad", "namespace": "ns"},
            "spec": {"claimRef": {"name": "c".repeat(70)}}
        }));
        let (count, drift) = classify(&interfaces, "dfw", &[invalid], &[], &routed());
        assert_eq!((count, drift.invalid, drift.missing), (1, 1, 0));
    }

    fn rules_networks_only() -> Vec<Rule> {
        vec![rule("networks"), rule("subnets")]
    }

    const METRICS: &str = "\
replicator_propagation_lag_seconds_bucket{kind=\"Network\",location=\"dfw\",le=\"0.01\"} 2
replicator_propagation_lag_seconds_bucket{kind=\"Network\",location=\"dfw\",le=\"0.02\"} 8
replicator_propagation_lag_seconds_bucket{kind=\"Network\",location=\"dfw\",le=\"0.04\"} 10
replicator_propagation_lag_seconds_bucket{kind=\"Network\",location=\"dfw\",le=\"+Inf\"} 10
replicator_propagation_lag_seconds_count{kind=\"Network\",location=\"dfw\"} 10
replicator_last_sync_timestamp_seconds{kind=\"Network\",location=\"dfw\"} 1767225590.5
replicator_leader{location=\"dfw\"} 1
";

    #[test]
    fn rows_combine_hub_cell_and_metrics_per_location_and_kind() {
        let rules = rules_networks_only();
        let source = network("ns", "a", 1460);
        let dfw_copy = copy_of(&source, "dfw", "2026-01-01T00:00:00Z");
        let sjc_copy = copy_of(&source, "sjc", "2026-01-01T00:00:05Z");
        let inputs = Inputs {
            rules: &rules,
            hub: vec![Ok(vec![dfw_copy, sjc_copy]), Err("subnets: forbidden".into())],
            cells: vec![
                CellInput {
                    location: "dfw".into(),
                    read: Ok(CellListing {
                        namespaces: routed(),
                        sources: vec![Ok(vec![source.clone()]), Ok(vec![])],
                    }),
                },
                CellInput {
                    location: "lax".into(),
                    read: Err("kubeconfig /x is missing or empty".into()),
                },
            ],
            metrics: vec![
                MetricsInput {
                    url: "http://a/metrics".into(),
                    location: None,
                    samples: Ok(parse(METRICS).unwrap()),
                },
                MetricsInput {
                    url: "http://b/metrics".into(),
                    location: Some("sjc".into()),
                    samples: Err("connection refused".into()),
                },
                MetricsInput {
                    url: "http://c/metrics".into(),
                    location: None,
                    samples: Err("timed out".into()),
                },
            ],
            namespace: Some("ns".into()),
            now: "2026-01-01T00:00:00Z".parse().unwrap(),
        };
        let report = build(&inputs);
        let locs: Vec<(&str, &str)> = report
            .rows
            .iter()
            .map(|r| (r.location.as_str(), r.kind.as_str()))
            .collect();
        assert_eq!(
            locs,
            [
                ("dfw", "Network"),
                ("dfw", "Subnet"),
                ("lax", "Network"),
                ("lax", "Subnet"),
                ("sjc", "Network"),
                ("sjc", "Subnet"),
            ]
        );
        let dfw = &report.rows[0];
        assert_eq!((dfw.copies, dfw.sources), (Some(1), Some(1)));
        assert_eq!(dfw.drift.as_ref().map(|d| d.in_sync), Some(1));
        assert_eq!(dfw.last_write.as_deref(), Some("2026-01-01T00:00:00Z"));
        assert_eq!(dfw.last_sync.as_deref(), Some("2025-12-31T23:59:50.5Z"));
        let lag = dfw.lag.as_ref().unwrap();
        assert_eq!(lag.count, 10);
        assert!((lag.p50.unwrap() - 0.015).abs() < 1e-9, "{lag:?}");
        assert!((lag.p95.unwrap() - 0.035).abs() < 1e-9, "{lag:?}");
        assert_eq!(dfw.leader, Some(true));
        assert_eq!((dfw.cell, dfw.metrics), (Reach::Ok, Reach::Ok));
        assert!(dfw.errors.is_empty());

        let dfw_subnet = &report.rows[1];
        assert_eq!(dfw_subnet.copies, None);
        assert_eq!(dfw_subnet.sources, Some(0));
        assert_eq!(dfw_subnet.drift, None);
        assert_eq!(dfw_subnet.lag, None);
        assert_eq!(dfw_subnet.errors, ["hub: listing Subnet: subnets: forbidden"]);

        let lax = &report.rows[2];
        assert_eq!((lax.copies, lax.sources, lax.cell), (Some(0), None, Reach::Unreachable));
        assert_eq!(lax.errors, ["cell lax: kubeconfig /x is missing or empty"]);

        let sjc = &report.rows[4];
        assert_eq!((sjc.copies, sjc.sources, sjc.cell), (Some(1), None, Reach::NotGiven));
        assert_eq!(sjc.metrics, Reach::Unreachable);
        assert_eq!(sjc.leader, None);
        assert_eq!(sjc.last_write.as_deref(), Some("2026-01-01T00:00:05Z"));
        assert_eq!(sjc.errors, ["metrics http://b/metrics: connection refused"]);
        assert_eq!(report.problems, ["metrics http://c/metrics: timed out"]);

        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["rows"][0]["drift"]["inSync"], 1);
        assert_eq!(json["rows"][0]["lastWrite"], "2026-01-01T00:00:00Z");
        assert_eq!(json["rows"][2]["cell"], "unreachable");
        assert_eq!(json["rows"][4]["cell"], "not-given");

        let table = table(&report);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("LOCATION  KIND     COPIES  SOURCES"), "{table}");
        let dfw_line: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            dfw_line,
            [
                "dfw", "Network", "1", "1", "1", "0", "0", "0", "0s", "ago", "9s", "ago", "15ms", "35ms", "39ms", "yes"
            ],
            "{table}"
        );
        assert!(lines[3].contains("unreachable"), "{table}");
        assert!(
            table.contains("problems:\n  hub: listing Subnet: subnets: forbidden\n"),
            "{table}"
        );
        assert!(table.contains("  metrics http://c/metrics: timed out\n"), "{table}");
    }

    #[test]
    fn short_durations() {
        assert_eq!(short_seconds(0.000_85), "850µs");
        assert_eq!(short_seconds(0.012), "12ms");
        assert_eq!(short_seconds(1.54), "1.5s");
        assert_eq!(short_seconds(42.0), "42s");
        assert_eq!(short_seconds(600.0), "10m");
        assert_eq!(short_seconds(3.0 * 3600.0), "3h");
        assert_eq!(short_seconds(4.0 * 86400.0), "4d");
        assert_eq!(short_seconds(f64::NAN), "-");
    }
}
