//! `replicator status`: per location and kind, the copies on the hub, the sources in the cells,
//! drift, last sync, propagation lag percentiles and leadership (issue #6, "Operator view").
//!
//! This module is the thin I/O: it lists the hub (required: an unreachable hub is an error),
//! each `--cell` (an unreachable cell shows in its rows) and scrapes each `--metrics` endpoint
//! (likewise), all concurrently and each bounded by `--timeout`; [`report`] turns what was read
//! into rows without I/O, and [`exposition`] reads the Prometheus text format.

pub mod exposition;
pub mod report;

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use k8s_openapi::{api::core::v1::Namespace, jiff::Timestamp};
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, ListParams},
};

use crate::{cluster, rules};
use report::{CellInput, CellListing, Inputs, MetricsInput};

/// Output format of `replicator status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// An aligned table, times as ages, then the problems.
    Table,
    /// The report as JSON (rows with counts, RFC 3339 times, lag in seconds, errors).
    Json,
}

/// `LOCATION=KUBECONFIG` of `--cell`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellTarget {
    /// The location the cell publishes as.
    pub location: String,
    /// Its kubeconfig.
    pub kubeconfig: PathBuf,
}

/// `[LOCATION=]URL` of `--metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsTarget {
    /// The location, when given (a failed scrape then shows in that location's rows).
    pub location: Option<String>,
    /// The `/metrics` URL (http or https).
    pub url: String,
}

/// Parses `--cell LOCATION=KUBECONFIG`.
///
/// # Errors
/// A message when the `=` is missing, the location is not a DNS label or the path is empty.
pub fn parse_cell(s: &str) -> Result<CellTarget, String> {
    let (location, path) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not LOCATION=KUBECONFIG"))?;
    if !rules::is_dns_label(location) {
        return Err(format!("location {location:?} is not a DNS label"));
    }
    if path.is_empty() {
        return Err(format!("{s:?} names no kubeconfig"));
    }
    Ok(CellTarget {
        location: location.to_owned(),
        kubeconfig: PathBuf::from(path),
    })
}

/// Parses `--metrics [LOCATION=]URL`.
///
/// # Errors
/// A message unless the URL (after an optional DNS-label location and `=`) starts with
/// `http://` or `https://`.
pub fn parse_metrics(s: &str) -> Result<MetricsTarget, String> {
    let is_url = |u: &str| u.starts_with("http://") || u.starts_with("https://");
    if is_url(s) {
        return Ok(MetricsTarget {
            location: None,
            url: s.to_owned(),
        });
    }
    match s.split_once('=') {
        Some((location, url)) if rules::is_dns_label(location) && is_url(url) => Ok(MetricsTarget {
            location: Some(location.to_owned()),
            url: url.to_owned(),
        }),
        _ => Err(format!(
            "{s:?} is not URL or LOCATION=URL with an http:// or https:// URL"
        )),
    }
}

/// Flags of `replicator status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Kubeconfig of the hub (required). The command fails when the hub does not answer.
    #[arg(long, env = "REPLICATOR_HUB_KUBECONFIG")]
    pub hub_kubeconfig: PathBuf,
    /// A cell to compare with, `LOCATION=KUBECONFIG` (repeat for each): counts its sources and
    /// judges drift. An unreachable cell shows in its rows.
    #[arg(long = "cell", value_name = "LOCATION=KUBECONFIG", value_parser = parse_cell)]
    pub cells: Vec<CellTarget>,
    /// A replicator's metrics endpoint, `URL` or `LOCATION=URL` (repeat): lag percentiles, last
    /// sync and leader. An unreachable endpoint shows in its location's rows when named.
    #[arg(long = "metrics", value_name = "[LOCATION=]URL", value_parser = parse_metrics)]
    pub metrics: Vec<MetricsTarget>,
    /// YAML file adding or overriding rules, as for `replicator run`.
    #[arg(long, env = "REPLICATOR_RULES")]
    pub rules: Option<PathBuf>,
    /// Only this namespace (default: all). Metrics are process-wide and never limited.
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value = "table")]
    pub output: Output,
    /// Bound on reaching each cluster or endpoint, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = crate::runtime::parse_duration)]
    pub timeout: Duration,
}

/// An error and its sources, `outer: inner: ...`, skipping a source the text already quotes.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// Bounds `fut` by `timeout`, flattening both failures into a message.
async fn bounded<T, E: std::error::Error>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(error_chain(&e)),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Lists every object of `api` matching `params`, page by page (500 per page).
async fn list_all(api: &Api<DynamicObject>, params: ListParams) -> Result<Vec<DynamicObject>, kube::Error> {
    let mut params = params.limit(500);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

fn api_for(client: &Client, rule: &rules::Rule, namespace: Option<&str>) -> Api<DynamicObject> {
    let resource = rule.resource.api_resource();
    match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// Reads one cell: namespaces (for routing) and, per rule, the sources its selector matches.
async fn read_cell(
    target: &CellTarget,
    rules: &[rules::Rule],
    namespace: Option<&str>,
    timeout: Duration,
) -> Result<CellListing, String> {
    let client = cluster::client_from_kubeconfig(&target.kubeconfig)
        .await
        .map_err(|e| error_chain(&e))?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let listed = bounded(timeout, async {
        match namespace {
            Some(ns) => namespaces.get_opt(ns).await.map(|n| n.into_iter().collect::<Vec<_>>()),
            None => namespaces.list(&ListParams::default()).await.map(|l| l.items),
        }
    })
    .await?;
    let namespaces = listed
        .into_iter()
        .map(|ns| (ns.name_any(), ns.labels().clone()))
        .collect();
    let sources = futures::future::join_all(rules.iter().map(|rule| async {
        let selector = rules::source_selector(rule).map_err(|e| error_chain(&e))?;
        let params = ListParams::default().labels_from(&selector);
        bounded(timeout, list_all(&api_for(&client, rule, namespace), params)).await
    }))
    .await;
    Ok(CellListing { namespaces, sources })
}

async fn scrape(http: &reqwest::Client, target: &MetricsTarget) -> Result<Vec<exposition::Sample>, String> {
    let response = http.get(&target.url).send().await.map_err(|e| error_chain(&e))?;
    let text = response
        .error_for_status()
        .map_err(|e| error_chain(&e))?
        .text()
        .await
        .map_err(|e| error_chain(&e))?;
    exposition::parse(&text).map_err(|e| e.to_string())
}

/// Gathers every input and builds the report.
///
/// # Errors
/// Unreadable rules, an unusable hub kubeconfig, or a hub that does not answer within the
/// timeout. Cells and metrics endpoints never fail the command: their rows say what went wrong.
pub async fn gather(args: &StatusArgs) -> anyhow::Result<report::Report> {
    let rules = rules::load(args.rules.as_deref())?;
    let hub_path = args.hub_kubeconfig.display();
    let hub = cluster::client_from_kubeconfig(&args.hub_kubeconfig)
        .await
        .map_err(|e| anyhow::anyhow!("hub: {}", error_chain(&e)))?;
    bounded(args.timeout, hub.apiserver_version())
        .await
        .map_err(|e| anyhow::anyhow!("the hub (kubeconfig {hub_path}) is unreachable: {e}"))?;
    let namespace = args.namespace.as_deref();
    let hub_lists = futures::future::join_all(rules.iter().map(|rule| {
        let api = api_for(&hub, rule, namespace);
        let params = ListParams::default().labels(rules::LOCATION_LABEL);
        bounded(args.timeout, async move { list_all(&api, params).await })
    }));
    let cells = futures::future::join_all(args.cells.iter().map(|target| async {
        CellInput {
            location: target.location.clone(),
            read: read_cell(target, &rules, namespace, args.timeout).await,
        }
    }));
    let http = reqwest::Client::builder()
        .timeout(args.timeout)
        .build()
        .context("building the HTTP client")?;
    let metrics = futures::future::join_all(args.metrics.iter().map(|target| {
        let http = &http;
        async move {
            MetricsInput {
                url: target.url.clone(),
                location: target.location.clone(),
                samples: scrape(http, target).await,
            }
        }
    }));
    let (hub, cells, metrics) = tokio::join!(hub_lists, cells, metrics);
    Ok(report::build(&Inputs {
        rules: &rules,
        hub,
        cells,
        metrics,
        namespace: args.namespace.clone(),
        now: Timestamp::now(),
    }))
}

/// Runs `replicator status`: prints the report to stdout in the chosen format.
///
/// # Errors
/// As [`gather`], or a report that cannot be serialized.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let report = gather(&args).await?;
    match args.output {
        Output::Table => print!("{}", report::table(&report)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chains_quote_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {0}")]
        struct Quoting(#[source] std::io::Error);
        let io = || std::io::Error::other("refused");
        assert_eq!(error_chain(&Outer(io())), "outer: refused");
        assert_eq!(error_chain(&Quoting(io())), "outer: refused");
    }

    #[test]
    fn cell_and_metrics_flags_parse() {
        assert_eq!(
            parse_cell("dfw=/k/cell-a.kubeconfig"),
            Ok(CellTarget {
                location: "dfw".into(),
                kubeconfig: "/k/cell-a.kubeconfig".into()
            })
        );
        assert!(parse_cell("/k/cell-a.kubeconfig").is_err());
        assert!(parse_cell("DFW=/k").is_err());
        assert!(parse_cell("dfw=").is_err());
        assert_eq!(
            parse_metrics("http://127.0.0.1:8080/metrics?x=1"),
            Ok(MetricsTarget {
                location: None,
                url: "http://127.0.0.1:8080/metrics?x=1".into()
            })
        );
        assert_eq!(
            parse_metrics("sjc=https://r.sjc:8080/metrics"),
            Ok(MetricsTarget {
                location: Some("sjc".into()),
                url: "https://r.sjc:8080/metrics".into()
            })
        );
        assert!(parse_metrics("sjc=ftp://x").is_err());
        assert!(parse_metrics("127.0.0.1:8080/metrics").is_err());
    }
}
