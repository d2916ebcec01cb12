//! Prometheus metrics of `replicator run` (docs/architecture.md; names are fixed there).
//!
//! Labels are small closed sets (kind, location, op, class), never object names.

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use std::sync::{OnceLock, atomic::AtomicU64};

/// Labels of per-kind, per-location series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The mirrored kind, e.g. `NetworkInterface`.
    pub kind: String,
    /// The publishing location.
    pub location: String,
}

/// A hub write outcome.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)] // the label values are the variant names, lowercase on the wire
pub enum WriteOp {
    /// The copy did not exist and was applied.
    create,
    /// The copy existed and was applied.
    update,
    /// The copy was deleted (watched delete, withdrawal or sweep).
    delete,
    /// The copy already held the desired content: no request was sent.
    skipped,
    /// The copy differed from its source in an immutable field (a slice's `addressType`): it
    /// was deleted and created again.
    replace,
}

/// Labels of `replicator_writes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// The mirrored kind.
    pub kind: String,
    /// The publishing location.
    pub location: String,
    /// The outcome.
    pub op: WriteOp,
}

/// Labels of `replicator_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The mirrored kind, or `Lease` for the location's leader election.
    pub kind: String,
    /// The publishing location.
    pub location: String,
    /// The error class (see `sync::ErrorClass::metric_label`).
    pub class: &'static str,
}

/// Labels of process-wide, per-location series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocationLabels {
    /// The publishing location.
    pub location: String,
}

/// Labels of `replicator_api_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// The cluster the client talks to: `cell` or `hub`.
    pub cluster: &'static str,
    /// The Kubernetes verb of the request (see [`api_verb`]).
    pub verb: &'static str,
    /// The resource (plural, e.g. `networkinterfaces`, `leases`; see [`api_resource`]), so the
    /// cost of the copies can be told from that of leader election and Events.
    pub resource: String,
    /// The HTTP status code of the response (`200`, `404`, `409`, ...), or [`NO_RESPONSE`] when
    /// the request got none (see [`api_code`]); client-go's `rest_client_requests_total{code}`.
    pub code: String,
}

/// The `code` of a request that got no HTTP response (connection refused, TLS failure, timeout,
/// the request dropped before an answer): client-go's value for the same case.
pub const NO_RESPONSE: &str = "<error>";

/// The `code` label of a request's outcome: the response's status code, or [`NO_RESPONSE`].
pub fn api_code<B, E>(outcome: &Result<http::Response<B>, E>) -> String {
    match outcome {
        Ok(response) => response.status().as_str().to_owned(),
        Err(_) => NO_RESPONSE.to_owned(),
    }
}

/// The process-wide family behind `replicator_api_requests_total`: every Kubernetes API request
/// the process sends, by cluster, verb, resource and code, counted once its response headers
/// arrive or it ends without an answer (see `cluster::counted_client`).
///
/// Process-wide because the clients are built before (and independently of) the registry;
/// [`Metrics::register`] exports it.
pub fn api_requests() -> &'static Family<ApiRequestLabels, Counter> {
    static FAMILY: OnceLock<Family<ApiRequestLabels, Counter>> = OnceLock::new();
    FAMILY.get_or_init(Family::default)
}

/// Labels of `replicator_api_request_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLatencyLabels {
    /// The cluster the client talks to: `cell` or `hub`.
    pub cluster: &'static str,
    /// The Kubernetes verb of the request (see [`api_verb`]).
    pub verb: &'static str,
}

/// The process-wide family behind `replicator_api_request_duration_seconds`: seconds from a
/// request being sent to its response headers arriving (for a watch, until the stream opens),
/// by cluster and verb; client-go's `rest_client_request_duration_seconds`. Beside
/// [`Metrics::sync_duration`] it tells a slow apiserver from a slow pass (issue #5).
pub fn api_request_duration() -> &'static Family<ApiLatencyLabels, Histogram> {
    static FAMILY: OnceLock<Family<ApiLatencyLabels, Histogram>> = OnceLock::new();
    FAMILY.get_or_init(|| Family::new_with_constructor(lag_histogram))
}

/// The Kubernetes verb of an API request, as the apiserver's audit log names it: `watch`
/// (`?watch=true`), `list` and `get` (GET of a collection or of one object), `create`, `update`,
/// `patch`, `delete`, `deletecollection`; `get` for GETs outside `/api` and `/apis` resources
/// (`/version`, discovery) and `other` for anything else.
pub fn api_verb(method: &http::Method, uri: &http::Uri) -> &'static str {
    use http::Method;
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    if watch {
        return "watch";
    }
    let segments = path_segments(uri);
    let resource = resource_segments(&segments);
    let collection = resource.len() == 1;
    match *method {
        Method::GET if resource.is_empty() => "get",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if collection => "deletecollection",
        Method::DELETE => "delete",
        _ => "other",
    }
}

/// The resource an API request addresses, as the apiserver's metrics name it: the plural
/// (`endpointslices`, `networkinterfaces`, `leases`, `namespaces`); empty for paths outside
/// `/api` and `/apis` resources (`/version`, discovery).
pub fn api_resource(uri: &http::Uri) -> String {
    resource_segments(&path_segments(uri))
        .first()
        .map(|s| (*s).to_owned())
        .unwrap_or_default()
}

fn path_segments(uri: &http::Uri) -> Vec<&str> {
    uri.path().split('/').filter(|s| !s.is_empty()).collect()
}

/// `<resource>[/<name>[/<subresource>]]` of a resource path.
fn resource_segments<'a, 'b>(segments: &'b [&'a str]) -> &'b [&'a str] {
    let resource = match segments {
        ["api", _, rest @ ..] | ["apis", _, _, rest @ ..] => rest,
        _ => &[],
    };
    // `namespaces/<ns>/<resource>...` is a namespaced resource; `namespaces[/<name>]` itself is
    // the cluster-scoped Namespace kind.
    match resource {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    }
}

/// Labels of `replicator_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildInfoLabels {
    /// The crate version (`CARGO_PKG_VERSION`).
    pub version: &'static str,
    /// The git commit the binary was built from, as `--version` prints it (`unknown` without git).
    pub commit: &'static str,
}

/// The labels of this binary's `replicator_build_info`.
pub const BUILD_INFO: BuildInfoLabels = BuildInfoLabels {
    version: env!("CARGO_PKG_VERSION"),
    commit: env!("REPLICATOR_BUILD_COMMIT"),
};

/// Registers what every long-running subcommand exports besides its own metrics:
/// `replicator_build_info{version,commit}` (always 1) and the conventional, unprefixed process
/// metrics ([`crate::process_metrics`]), read at scrape time.
pub fn register_process(registry: &mut Registry) {
    let build_info = Family::<BuildInfoLabels, Gauge>::default();
    build_info.get_or_create(&BUILD_INFO).set(1);
    registry.register(
        "replicator_build_info",
        "Always 1; the labels name the version and the git commit of the running binary",
        build_info,
    );
    registry.register_collector(Box::new(crate::process_metrics::ProcessCollector));
}

/// Every metric of `replicator run`, registered under the `replicator_` prefix.
#[derive(Clone)]
pub struct Metrics {
    /// `replicator_propagation_lag_seconds`: source change observed → hub write acknowledged.
    pub propagation_lag: Family<KindLabels, Histogram>,
    /// `replicator_queue_wait_seconds`: how long a key waited in the work queue before a worker
    /// took it (client-go's workqueue queue duration). With [`Metrics::sync_duration`] it splits
    /// the propagation lag into waiting for a worker and the pass itself (issue #5).
    pub queue_wait: Family<KindLabels, Histogram>,
    /// `replicator_sync_duration_seconds`: how long one sync pass over a key took, hub round
    /// trips included, whatever its outcome.
    pub sync_duration: Family<KindLabels, Histogram>,
    /// `replicator_queue_depth`: keys waiting in a location's work queue for a worker (client-go's
    /// `workqueue_depth`): not the keys being processed, waiting out a retry backoff, or parked
    /// until their kind has listed.
    pub queue_depth: Family<LocationLabels, Gauge>,
    /// `replicator_copies`: copies this location has on the hub (hub cache size).
    pub copies: Family<KindLabels, Gauge>,
    /// `replicator_writes_total`: hub writes by outcome.
    pub writes: Family<WriteLabels, Counter>,
    /// `replicator_errors_total`: errors by class (failed writes, failed watches of the copies
    /// and sources, failed Lease requests under `kind="Lease"`).
    pub errors: Family<ErrorLabels, Counter>,
    /// `replicator_sweep_deleted_total`: copies the sweep collected.
    pub sweep_deleted: Family<KindLabels, Counter>,
    /// `replicator_sweep_runs_total`: completed sweep passes.
    pub sweep_runs: Family<LocationLabels, Counter>,
    /// `replicator_unroutable_objects`: sources not published because their namespace lacks
    /// routing labels.
    pub unroutable: Family<KindLabels, Gauge>,
    /// `replicator_source_up`: 1 while the cell watch of a kind is listed and healthy.
    pub source_up: Family<KindLabels, Gauge>,
    /// `replicator_hub_up`: 1 while the hub answers and accepts this process's credentials; 0
    /// until the first probe answers, and while the hub is unreachable or answers 401. A 403 to
    /// a request every replica needs (the copy lists, the Lease) keeps it 1 but the process not
    /// ready (`/readyz` names it) and counts in `replicator_errors_total{class="forbidden"}`.
    pub hub_up: Family<LocationLabels, Gauge>,
    /// `replicator_last_sync_timestamp_seconds`: Unix time of the last successful write or
    /// verified no-op of a kind.
    pub last_sync: Family<KindLabels, Gauge<f64, AtomicU64>>,
    /// `replicator_leader`: 1 while this process holds the location's Lease (writes and sweeps).
    pub leader: Family<LocationLabels, Gauge>,
    /// `replicator_cell_up`: 1 while the cell apiserver answers `/version`.
    pub cell_up: Family<LocationLabels, Gauge>,
    /// `replicator_location_conflict`: 1 while copies under this location's label were published
    /// by another cell (one cell per location); this replica then writes nothing.
    pub location_conflict: Family<LocationLabels, Gauge>,
    /// `replicator_withdrawn_total`: copies withdrawn from the hub because their cell stayed
    /// unreachable past the grace period (`--withdraw-unreachable-after`).
    pub withdrawn: Family<KindLabels, Counter>,
    /// `replicator_api_requests_total`: Kubernetes API requests, by cluster, verb, resource and
    /// response code (the process-wide [`api_requests`]).
    pub api_requests: Family<ApiRequestLabels, Counter>,
    /// `replicator_api_request_duration_seconds`: request sent → response headers, by cluster
    /// and verb (the process-wide [`api_request_duration`]).
    pub api_request_duration: Family<ApiLatencyLabels, Histogram>,
}

fn lag_histogram() -> Histogram {
    // 1 ms .. ~65 s in powers of two: resolves sub-10 ms relay floors and multi-second outages.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 17,
    ))
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` under the `replicator_` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            propagation_lag: Family::new_with_constructor(lag_histogram),
            queue_wait: Family::new_with_constructor(lag_histogram),
            sync_duration: Family::new_with_constructor(lag_histogram),
            queue_depth: Family::default(),
            copies: Family::default(),
            writes: Family::default(),
            errors: Family::default(),
            sweep_deleted: Family::default(),
            sweep_runs: Family::default(),
            unroutable: Family::default(),
            source_up: Family::default(),
            hub_up: Family::default(),
            last_sync: Family::default(),
            leader: Family::default(),
            cell_up: Family::default(),
            location_conflict: Family::default(),
            withdrawn: Family::default(),
            api_requests: api_requests().clone(),
            api_request_duration: api_request_duration().clone(),
        };
        let r = registry.sub_registry_with_prefix("replicator");
        r.register(
            "propagation_lag_seconds",
            "Seconds from a source change observed in a cell to the hub acknowledging the write",
            m.propagation_lag.clone(),
        );
        r.register(
            "queue_wait_seconds",
            "Seconds a key waited in the work queue before a worker took it",
            m.queue_wait.clone(),
        );
        r.register(
            "sync_duration_seconds",
            "Seconds one sync pass over a key took, hub round trips included",
            m.sync_duration.clone(),
        );
        r.register(
            "queue_depth",
            "Keys waiting in the location's work queue for a worker (not those being processed, waiting out a retry backoff, or parked until their kind has listed)",
            m.queue_depth.clone(),
        );
        r.register("copies", "Copies this location has on the hub", m.copies.clone());
        r.register(
            "writes",
            "Hub writes by outcome; skipped means the copy already held the content",
            m.writes.clone(),
        );
        r.register(
            "errors",
            "Errors by class: unreachable (no answer), forbidden (401 credentials rejected or 403 no role), transient, invalid, namespace_missing, not_ours, source_invalid; kind is the mirrored kind, or Lease for the location's leader election",
            m.errors.clone(),
        );
        r.register(
            "sweep_deleted",
            "Copies collected by the sweep because their source is gone",
            m.sweep_deleted.clone(),
        );
        r.register("sweep_runs", "Completed sweep passes", m.sweep_runs.clone());
        r.register(
            "unroutable_objects",
            "Sources not published because their namespace lacks the project routing labels",
            m.unroutable.clone(),
        );
        r.register(
            "source_up",
            "1 while the cell watch of a kind has listed and is healthy",
            m.source_up.clone(),
        );
        r.register(
            "hub_up",
            "1 while the hub apiserver answers and accepts this process's credentials; 0 while it is unreachable or answers 401 (credentials rejected); a 403 (no role) to the copy lists or the Lease keeps it 1 but the process not ready: /readyz names the reason, replicator_errors_total{class=\"unreachable\"|\"forbidden\"} counts the attempts",
            m.hub_up.clone(),
        );
        r.register(
            "last_sync_timestamp_seconds",
            "Unix time of the last successful hub write or verified no-op of a kind",
            m.last_sync.clone(),
        );
        r.register(
            "leader",
            "1 while this process holds the location's Lease and is its writer",
            m.leader.clone(),
        );
        r.register("cell_up", "1 while the cell apiserver answers", m.cell_up.clone());
        r.register(
            "location_conflict",
            "1 while copies under this location's label were published by another cell; this one then writes nothing",
            m.location_conflict.clone(),
        );
        r.register(
            "withdrawn",
            "Copies withdrawn from the hub because their cell stayed unreachable past the grace period",
            m.withdrawn.clone(),
        );
        r.register(
            "api_requests",
            "Kubernetes API requests, by cluster (cell, hub), verb (get, list, watch, create, update, patch, delete, deletecollection, other), resource and code (the HTTP status code of the response, <error> when there was none), counted when the response headers arrive or the request ends without them",
            m.api_requests.clone(),
        );
        r.register(
            "api_request_duration_seconds",
            "Seconds from a Kubernetes API request sent to its response headers, by cluster and verb",
            m.api_request_duration.clone(),
        );
        m
    }
}

/// Encodes `registry` in the OpenMetrics text format (what `/metrics` serves, ending in `# EOF`).
///
/// # Errors
/// Only a formatter error, which writing to a `String` never produces.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Encodes `registry` in the classic Prometheus text format 0.0.4: [`encode`]'s body through
/// [`openmetrics_to_text`]. Served by `/metrics` to a client that asks for `text/plain` (and
/// what `promtool check metrics` lints).
///
/// # Errors
/// As [`encode`].
pub fn encode_text(registry: &Registry) -> Result<String, std::fmt::Error> {
    encode(registry).map(|body| openmetrics_to_text(&body))
}

/// Rewrites the OpenMetrics 1.0 text `prometheus-client` writes as Prometheus text format 0.0.4,
/// sample for sample. The two differ only in their metadata:
/// - a counter family `x` (samples `x_total`) is named `x_total` in its `# HELP` and `# TYPE`;
/// - an info family `x` (samples `x_info`) becomes gauge `x_info`; `unknown` becomes `untyped`;
/// - `# UNIT` and `# EOF` lines, `_created` samples of counters and exemplars are dropped;
/// - `\"` in help text (OpenMetrics escapes quotes there) becomes `"`.
///
/// Pure; lines it does not recognise pass through unchanged.
pub fn openmetrics_to_text(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    // The family whose metadata was last seen: its name and OpenMetrics type.
    let mut family: Option<(String, String)> = None;
    let mut help: Option<(String, String)> = None;
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name.to_owned(), text.replace("\\\"", "\"")));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (text_name, text_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            match help.take() {
                Some((help_name, text)) if help_name == name => out.push_str(&format!("# HELP {text_name} {text}\n")),
                Some((help_name, text)) => out.push_str(&format!("# HELP {help_name} {text}\n")),
                None => {}
            }
            out.push_str(&format!("# TYPE {text_name} {text_kind}\n"));
            family = Some((name.to_owned(), kind.to_owned()));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        if let Some((name, text)) = help.take() {
            // A help line with no type line after it: keep it as it was.
            out.push_str(&format!("# HELP {name} {text}\n"));
        }
        if line.starts_with('#') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let sample = without_exemplar(line);
        let created = family
            .as_ref()
            .is_some_and(|(name, kind)| kind == "counter" && sample.starts_with(&format!("{name}_created")));
        if !created {
            out.push_str(sample);
            out.push('\n');
        }
    }
    out
}

/// `line` without a trailing ` # {...} value` exemplar: the first ` # ` outside a quoted label
/// value.
fn without_exemplar(line: &str) -> &str {
    let bytes = line.as_bytes();
    let (mut quoted, mut escaped) = (false, false);
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'#' if !quoted && i > 0 && bytes[i - 1] == b' ' => return line[..i - 1].trim_end(),
            _ => {}
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_becomes_classic_text() {
        let body = "\
# HELP replicator_writes Hub writes.
# TYPE replicator_writes counter
replicator_writes_total{op=\"create\",kind=\"a # b\"} 3 # {trace_id=\"x\"} 1.0
replicator_writes_created{op=\"create\",kind=\"a # b\"} 1700000000.0
# HELP replicator_copies Copies \\\"held\\\".
# TYPE replicator_copies gauge
replicator_copies 7
# HELP replicator_lag_seconds Lag.
# TYPE replicator_lag_seconds histogram
# UNIT replicator_lag_seconds seconds
replicator_lag_seconds_sum 1.5
replicator_lag_seconds_count 2
replicator_lag_seconds_bucket{le=\"+Inf\"} 2
# HELP replicator_build Build.
# TYPE replicator_build info
replicator_build_info{version=\"0.1.0\"} 1
# HELP replicator_odd Odd.
# TYPE replicator_odd unknown
replicator_odd 1
# EOF
";
        let expected = "\
# HELP replicator_writes_total Hub writes.
# TYPE replicator_writes_total counter
replicator_writes_total{op=\"create\",kind=\"a # b\"} 3
# HELP replicator_copies Copies \"held\".
# TYPE replicator_copies gauge
replicator_copies 7
# HELP replicator_lag_seconds Lag.
# TYPE replicator_lag_seconds histogram
replicator_lag_seconds_sum 1.5
replicator_lag_seconds_count 2
replicator_lag_seconds_bucket{le=\"+Inf\"} 2
# HELP replicator_build_info Build.
# TYPE replicator_build_info gauge
replicator_build_info{version=\"0.1.0\"} 1
# HELP replicator_odd Odd.
# TYPE replicator_odd untyped
replicator_odd 1
";
        assert_eq!(openmetrics_to_text(body), expected);
    }

    #[test]
    fn the_registry_in_classic_text_has_every_sample_of_the_openmetrics_body() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.copies
            .get_or_create(&KindLabels {
                kind: "NetworkInterface".into(),
                location: "dfw".into(),
            })
            .set(4);
        let openmetrics = encode(&registry).unwrap();
        let text = encode_text(&registry).unwrap();
        let samples = |body: &str| -> Vec<String> {
            body.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(samples(&openmetrics), samples(&text));
        assert!(
            text.contains("\nreplicator_copies{kind=\"NetworkInterface\",location=\"dfw\"} 4\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let name = line.split(' ').nth(2).unwrap();
            assert!(text.contains(&format!("# HELP {name} ")), "no help for {name}");
        }
    }

    #[test]
    fn names_are_the_fixed_design_names() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let kind = KindLabels {
            kind: "NetworkInterface".into(),
            location: "dfw".into(),
        };
        m.propagation_lag.get_or_create(&kind).observe(0.02);
        m.writes
            .get_or_create(&WriteLabels {
                kind: "NetworkInterface".into(),
                location: "dfw".into(),
                op: WriteOp::skipped,
            })
            .inc();
        m.errors
            .get_or_create(&ErrorLabels {
                kind: "NetworkInterface".into(),
                location: "dfw".into(),
                class: "invalid",
            })
            .inc();
        m.hub_up
            .get_or_create(&LocationLabels { location: "dfw".into() })
            .set(1);
        m.last_sync.get_or_create(&kind).set(1.5);
        for family in [&m.copies, &m.unroutable, &m.source_up] {
            family.get_or_create(&kind).set(2);
        }
        m.sweep_deleted.get_or_create(&kind).inc();
        m.leader
            .get_or_create(&LocationLabels { location: "dfw".into() })
            .set(1);
        let text = encode(&registry).unwrap();
        for line in [
            r#"replicator_propagation_lag_seconds_count{kind="NetworkInterface",location="dfw"} 1"#,
            r#"replicator_writes_total{kind="NetworkInterface",location="dfw",op="skipped"} 1"#,
            r#"replicator_errors_total{kind="NetworkInterface",location="dfw",class="invalid"} 1"#,
            r#"replicator_copies{kind="NetworkInterface",location="dfw"} 2"#,
            r#"replicator_unroutable_objects{kind="NetworkInterface",location="dfw"} 2"#,
            r#"replicator_source_up{kind="NetworkInterface",location="dfw"} 2"#,
            r#"replicator_hub_up{location="dfw"} 1"#,
            r#"replicator_last_sync_timestamp_seconds{kind="NetworkInterface",location="dfw"} 1.5"#,
            r#"replicator_sweep_deleted_total{kind="NetworkInterface",location="dfw"} 1"#,
            r#"replicator_leader{location="dfw"} 1"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn api_verbs_follow_the_audit_names() {
        let verb = |method: &str, uri: &str| {
            api_verb(
                &http::Method::from_bytes(method.as_bytes()).unwrap(),
                &uri.parse::<http::Uri>().unwrap(),
            )
        };
        let slices = "/apis/discovery.k8s.io/v1/namespaces/ns-1/endpointslices";
        assert_eq!(
            verb("GET", "/apis/discovery.k8s.io/v1/endpointslices?labelSelector=a"),
            "list"
        );
        assert_eq!(verb("GET", &format!("{slices}?watch=true&resourceVersion=5")), "watch");
        assert_eq!(verb("GET", &format!("{slices}/web-dfw")), "get");
        assert_eq!(
            verb("PATCH", &format!("{slices}/web-dfw?fieldManager=replicator-dfw")),
            "patch"
        );
        assert_eq!(
            verb(
                "PATCH",
                "/apis/networking.datumapis.com/v1alpha/namespaces/n/networkinterfaces/x/status"
            ),
            "patch"
        );
        assert_eq!(verb("DELETE", &format!("{slices}/web-dfw")), "delete");
        assert_eq!(verb("DELETE", slices), "deletecollection");
        assert_eq!(verb("POST", "/api/v1/namespaces/ns-1/events"), "create");
        assert_eq!(verb("PUT", "/api/v1/namespaces/ns-1"), "update");
        assert_eq!(verb("GET", "/api/v1/namespaces"), "list");
        assert_eq!(verb("GET", "/api/v1/namespaces/ns-1"), "get");
        assert_eq!(verb("GET", "/api/v1/namespaces?watch=1"), "watch");
        assert_eq!(verb("GET", "/version"), "get");
        assert_eq!(verb("GET", "/apis"), "get");
    }

    #[test]
    fn api_resources_are_the_plural_of_the_path() {
        let resource = |uri: &str| api_resource(&uri.parse::<http::Uri>().unwrap());
        assert_eq!(
            resource("/apis/discovery.k8s.io/v1/namespaces/ns-1/endpointslices/web-dfw"),
            "endpointslices"
        );
        assert_eq!(
            resource("/apis/networking.datumapis.com/v1alpha/networkinterfaces?labelSelector=a"),
            "networkinterfaces"
        );
        assert_eq!(
            resource("/apis/networking.datumapis.com/v1alpha/namespaces/p/networkinterfaces/ni-1/status"),
            "networkinterfaces"
        );
        assert_eq!(
            resource("/apis/coordination.k8s.io/v1/namespaces/replicator-system/leases/replicator-dfw"),
            "leases"
        );
        assert_eq!(resource("/api/v1/namespaces/ns-1"), "namespaces");
        assert_eq!(resource("/api/v1/namespaces"), "namespaces");
        assert_eq!(resource("/api/v1/namespaces/ns-1/events"), "events");
        assert_eq!(resource("/version"), "");
        assert_eq!(resource("/apis"), "");
    }

    #[test]
    fn api_requests_are_exported_by_cluster_and_verb() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let labels = ApiRequestLabels {
            cluster: "hub",
            verb: "watch",
            resource: "leases".into(),
            code: "200".into(),
        };
        let before = api_requests().get_or_create(&labels).get();
        api_requests().get_or_create(&labels).inc();
        assert_eq!(m.api_requests.get_or_create(&labels).get(), before + 1);
        let text = encode(&registry).unwrap();
        assert!(
            text.contains(r#"replicator_api_requests_total{cluster="hub",verb="watch",resource="leases",code="200"}"#),
            "{text}"
        );
    }

    #[test]
    fn api_codes_are_the_status_or_error() {
        let ok: Result<http::Response<()>, ()> = Ok(http::Response::builder().status(409).body(()).unwrap());
        assert_eq!(api_code(&ok), "409");
        let ok: Result<http::Response<()>, ()> = Ok(http::Response::new(()));
        assert_eq!(api_code(&ok), "200");
        let failed: Result<http::Response<()>, &str> = Err("connection refused");
        assert_eq!(api_code(&failed), "<error>");
    }

    #[test]
    fn build_info_and_queue_depth_are_exported() {
        let mut registry = Registry::default();
        register_process(&mut registry);
        let m = Metrics::register(&mut registry);
        m.queue_depth
            .get_or_create(&LocationLabels { location: "dfw".into() })
            .set(7);
        let text = encode(&registry).unwrap();
        let build = format!(
            r#"replicator_build_info{{version="{}",commit="{}"}} 1"#,
            env!("CARGO_PKG_VERSION"),
            env!("REPLICATOR_BUILD_COMMIT")
        );
        assert!(text.contains(&format!("{build}\n")), "missing {build} in\n{text}");
        assert!(text.contains("# TYPE replicator_build_info gauge\n"), "{text}");
        assert!(
            crate::runtime::VERSION.contains(BUILD_INFO.commit)
                && crate::runtime::VERSION.starts_with(BUILD_INFO.version),
            "the commit --version prints"
        );
        assert!(text.contains("replicator_queue_depth{location=\"dfw\"} 7\n"), "{text}");
        #[cfg(target_os = "linux")]
        assert!(
            text.contains("\nprocess_open_fds "),
            "unprefixed process metrics: {text}"
        );
        assert!(text.ends_with("# EOF\n"));
        let samples = crate::status::exposition::parse(&text).unwrap();
        assert!(
            samples
                .iter()
                .any(|s| s.name == "replicator_build_info" && (s.value - 1.0).abs() < f64::EPSILON),
            "`replicator status` reads the exposition with the new series"
        );
    }
}
