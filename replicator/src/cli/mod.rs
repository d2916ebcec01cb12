//! Command-line interface: the flags of `replicator run` and the other subcommands, their
//! parsers and checks, and the exit status of an outcome; the wiring of `run` is in `run.rs`.

mod run;

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::{
    election, outage, rules,
    runtime::{LogArgs, VERSION, parse_duration},
};

pub use run::run;

/// Mirrors network objects from Kubernetes cells onto a Karmada hub.
#[derive(Debug, Parser)]
#[command(name = "replicator", version = VERSION)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mirror cells onto the hub (one deployment per cell, or one process for several).
    Run(Box<RunArgs>),
    /// Resolve NetworkService membership on the hub: status and EndpointSlices (run once).
    Membership(crate::membership::MembershipArgs),
    /// Per location and kind: copies, sources, drift, last sync, lag percentiles, leader.
    Status(crate::status::StatusArgs),
    /// Print the project's CRDs as YAML (the content of config/crds/).
    Crds,
    /// Print the Karmada ClusterPropagationPolicies for these locations (policies/policies.yaml).
    Policies {
        /// A location with a cell (repeat for each); each gets a policy carrying its
        /// NetworkContext and Subnet copies to it.
        #[arg(long = "location", required = true, value_parser = parse_location)]
        locations: Vec<String>,
    },
}

/// Default `--workers`: concurrent hub writers per cell. A copy write takes 1.4 hub requests in
/// turn on average (the name check before a create, the status of a NetworkInterface), so the
/// writers bound throughput at `workers / (1.4 × hub round trip)`: 8 keep up with 200 changes/s
/// at a 25 ms round trip, where 4 fell behind in the issue #5 benchmark (10,000 objects, p50 300
/// ms against the relay's 14 ms: the queue, not the hub, was the limit).
pub const DEFAULT_WORKERS: usize = 8;

/// Flags of `replicator run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// This cell's location: the copy name suffix and the value of the location label
    /// (a DNS label, at most 63 characters). Use `--cell` instead to serve several cells.
    #[arg(
        long,
        env = "REPLICATOR_LOCATION",
        required_unless_present = "cells",
        conflicts_with = "cells",
        value_parser = parse_location
    )]
    pub location: Option<String>,
    /// Kubeconfig of the cell; the in-cluster service account when absent.
    #[arg(long, env = "REPLICATOR_CELL_KUBECONFIG", conflicts_with = "cells")]
    pub cell_kubeconfig: Option<PathBuf>,
    /// A cell this process serves, as LOCATION=KUBECONFIG (repeat for each; one client each,
    /// one Lease each). Replaces --location and --cell-kubeconfig.
    #[arg(long = "cell", id = "cells", value_name = "LOCATION=KUBECONFIG", value_parser = parse_cell)]
    pub cells: Vec<CellArg>,
    /// The hub kubeconfig of one `--cell`, as LOCATION=KUBECONFIG (repeat): a credential of that
    /// location's hub identity, service account `replicator-<location>`, which the hub's
    /// admission policy confines to the location's copies and Lease (config/rbac/hub). A cell
    /// without one uses --hub-kubeconfig. Cells sharing a file share one hub client.
    #[arg(
        long = "cell-hub-kubeconfig",
        id = "cell_hub_kubeconfigs",
        value_name = "LOCATION=KUBECONFIG",
        value_parser = parse_cell_hub,
        conflicts_with = "location"
    )]
    pub cell_hub_kubeconfigs: Vec<CellArg>,
    /// Kubeconfig of the hub: a credential of `replicator-<location>` (required unless every
    /// `--cell` has its --cell-hub-kubeconfig). While the file is missing or empty the process
    /// waits and reports not-ready.
    #[arg(
        long,
        env = "REPLICATOR_HUB_KUBECONFIG",
        required_unless_present = "cell_hub_kubeconfigs"
    )]
    pub hub_kubeconfig: Option<PathBuf>,
    /// Exit (status 0) once the content of --hub-kubeconfig differs from what the hub client was
    /// built from (read every 5 s; a missing or empty file is not a change), after the usual
    /// graceful shutdown (a leader releases its Lease, writes in flight finish): in a pod the
    /// kubelet restarts the container with the updated Secret, so a fixed kubeconfig needs no
    /// manual step. Set `false` under a supervisor that does not restart a process exiting 0:
    /// the file is then read once, at start.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "REPLICATOR_EXIT_ON_KUBECONFIG_CHANGE")]
    pub exit_on_kubeconfig_change: bool,
    /// Metrics and probe addresses.
    #[command(flatten)]
    pub serve: crate::http::ServeArgs,
    /// Time between sweeps of copies whose source is gone (jittered ±10 %), e.g. 10m, 1m30s, 1h.
    #[arg(long, default_value = "10m", value_parser = parse_sweep_interval)]
    pub sweep_interval: Duration,
    /// Most copies one sweep pass deletes.
    #[arg(long, default_value_t = 1000)]
    pub sweep_max_deletes: usize,
    /// YAML file adding or overriding rules (see README, "Rules").
    #[arg(long, env = "REPLICATOR_RULES")]
    pub rules: Option<PathBuf>,
    /// Concurrent hub writers (per cell).
    #[arg(long, default_value_t = DEFAULT_WORKERS)]
    pub workers: usize,
    /// Tell the watch events of the replicator's own hub writes apart, so they cost no pass
    /// (on by default; `false` exists to measure what it saves, with the benchmark).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, hide = true)]
    pub echo_bookkeeping: bool,
    /// Elect one writer per location on a hub Lease (`replicator-<location>`); with `false` this
    /// process writes unconditionally (run exactly one replica per location then).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "REPLICATOR_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Namespace of the Leases on the hub (created by config/rbac/hub).
    #[arg(long, default_value = "replicator-system", env = "REPLICATOR_LEASE_NAMESPACE")]
    pub lease_namespace: String,
    /// How long a Lease stays valid without renewal: a killed leader is replaced within this.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// How long before expiry the leader renews (below --lease-duration).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub lease_grace: Duration,
    /// This replica's identity in the Lease: `$POD_NAME`, else the host name, when absent. It is
    /// stable across restarts, so a restarted replica resumes its own Lease at once; give each
    /// process its own when several run on one host outside Kubernetes.
    #[arg(long, env = "REPLICATOR_IDENTITY")]
    pub identity: Option<String>,
    /// Withdraw a cell's copies from the hub once the cell has been unreachable this long, as
    /// DURATION (every cell) or LOCATION=DURATION (one cell; repeat). Unset: copies are kept
    /// through any outage.
    #[arg(long, value_name = "[LOCATION=]DURATION", value_parser = parse_withdraw)]
    pub withdraw_unreachable_after: Vec<(Option<String>, Duration)>,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// One `--cell LOCATION=KUBECONFIG` or `--cell-hub-kubeconfig LOCATION=KUBECONFIG`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellArg {
    /// The cell's location (a DNS label).
    pub location: String,
    /// Its kubeconfig.
    pub kubeconfig: PathBuf,
}

/// The location no cell may take: its hub identity would be `replicator-membership`, the
/// membership controller's account, which the hub's admission policy treats as such
/// (config/rbac/hub/admission_policy.yaml).
pub const RESERVED_LOCATION: &str = "membership";

/// Why `s` cannot be a location, if it cannot: a location is a DNS label (the copy name suffix,
/// a label value and the suffix of the hub identity `replicator-<location>`), other than
/// [`RESERVED_LOCATION`].
pub fn location_problem(s: &str) -> Option<String> {
    if !rules::is_dns_label(s) {
        Some(format!(
            "{s:?} is not a DNS label (lowercase letters, digits, '-', at most 63)"
        ))
    } else if s == RESERVED_LOCATION {
        Some(format!(
            "{s:?} is reserved: its hub identity replicator-{s} is the membership controller's"
        ))
    } else {
        None
    }
}

/// Checks a location (see [`location_problem`]).
///
/// # Errors
/// A message saying what a location is.
pub fn parse_location(s: &str) -> Result<String, String> {
    match location_problem(s) {
        None => Ok(s.to_owned()),
        Some(problem) => Err(problem),
    }
}

/// Parses `LOCATION=KUBECONFIG`.
///
/// # Errors
/// A message when the `=` is missing, the location is not a DNS label or the path is empty.
pub fn parse_cell(s: &str) -> Result<CellArg, String> {
    parse_location_path("--cell", s)
}

/// Parses `LOCATION=KUBECONFIG` of `--cell-hub-kubeconfig`.
///
/// # Errors
/// As [`parse_cell`].
pub fn parse_cell_hub(s: &str) -> Result<CellArg, String> {
    parse_location_path("--cell-hub-kubeconfig", s)
}

fn parse_location_path(flag: &str, s: &str) -> Result<CellArg, String> {
    let (location, path) = s
        .split_once('=')
        .ok_or_else(|| format!("{flag} {s:?} must be LOCATION=KUBECONFIG"))?;
    if let Some(problem) = location_problem(location) {
        return Err(format!("{flag} {s:?}: location {problem}"));
    }
    if path.is_empty() {
        return Err(format!("{flag} {s:?}: the kubeconfig path is empty"));
    }
    Ok(CellArg {
        location: location.to_owned(),
        kubeconfig: PathBuf::from(path),
    })
}

/// Parses `DURATION` or `LOCATION=DURATION` of `--withdraw-unreachable-after`.
///
/// # Errors
/// As [`parse_duration`], a location that is not a DNS label, or a grace under 10 s (a probe
/// runs every 2 s; a shorter grace withdraws on a blip).
pub fn parse_withdraw(s: &str) -> Result<(Option<String>, Duration), String> {
    let (location, duration) = match s.split_once('=') {
        Some((l, d)) => {
            if !rules::is_dns_label(l) {
                return Err(format!("--withdraw-unreachable-after {s:?}: {l:?} is not a location"));
            }
            (Some(l.to_owned()), d)
        }
        None => (None, s),
    };
    let d = parse_duration(duration)?;
    if d < Duration::from_secs(10) {
        return Err(format!("--withdraw-unreachable-after {s:?} must be at least 10s"));
    }
    Ok((location, d))
}

/// One cell a `replicator run` process serves, as its flags give it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellPlan {
    /// The location (a DNS label, not [`RESERVED_LOCATION`]).
    pub location: String,
    /// The cell's kubeconfig; `None`: the in-cluster service account.
    pub cell_kubeconfig: Option<PathBuf>,
    /// The hub kubeconfig of the location's identity: its `--cell-hub-kubeconfig`, else
    /// `--hub-kubeconfig`.
    pub hub_kubeconfig: PathBuf,
    /// What happens to the copies while the cell is unreachable.
    pub outage: outage::Policy,
}

/// The cells of `args`: `--cell` entries, or the single `--location` (with `--cell-kubeconfig`,
/// `None` meaning in-cluster), each with its hub kubeconfig and outage policy.
///
/// # Errors
/// A location that is not a location ([`location_problem`]) or is given twice; a
/// `--withdraw-unreachable-after` or `--cell-hub-kubeconfig` naming a location that is not
/// served, or given twice; a cell left without a hub kubeconfig.
pub fn cells(args: &RunArgs) -> anyhow::Result<Vec<CellPlan>> {
    let cells: Vec<(String, Option<PathBuf>)> = match &args.location {
        Some(location) => vec![(location.clone(), args.cell_kubeconfig.clone())],
        None => args
            .cells
            .iter()
            .map(|c| (c.location.clone(), Some(c.kubeconfig.clone())))
            .collect(),
    };
    let mut seen = std::collections::BTreeSet::new();
    for (location, _) in &cells {
        if let Some(problem) = location_problem(location) {
            anyhow::bail!("--location {problem}");
        }
        if !seen.insert(location.clone()) {
            anyhow::bail!("location {location:?} is given twice: each location is one cell");
        }
    }
    for (location, _) in &args.withdraw_unreachable_after {
        if let Some(l) = location
            && !seen.contains(l)
        {
            anyhow::bail!("--withdraw-unreachable-after names {l:?}, which this process does not serve");
        }
    }
    let mut hubs = std::collections::BTreeMap::new();
    for hub in &args.cell_hub_kubeconfigs {
        if !seen.contains(&hub.location) {
            anyhow::bail!(
                "--cell-hub-kubeconfig names {:?}, which this process does not serve",
                hub.location
            );
        }
        if hubs.insert(hub.location.clone(), hub.kubeconfig.clone()).is_some() {
            anyhow::bail!("--cell-hub-kubeconfig gives {:?} twice", hub.location);
        }
    }
    let policy = |location: &str| {
        let specific = args
            .withdraw_unreachable_after
            .iter()
            .rev()
            .find(|(l, _)| l.as_deref() == Some(location));
        let general = args.withdraw_unreachable_after.iter().rev().find(|(l, _)| l.is_none());
        specific
            .or(general)
            .map_or(outage::Policy::Keep, |(_, d)| outage::Policy::WithdrawAfter(*d))
    };
    cells
        .into_iter()
        .map(|(location, cell_kubeconfig)| {
            let hub_kubeconfig = hubs
                .remove(&location)
                .or_else(|| args.hub_kubeconfig.clone())
                .ok_or_else(|| {
                    anyhow::anyhow!("cell {location:?} has no hub kubeconfig: give --cell-hub-kubeconfig {location}=PATH or --hub-kubeconfig")
                })?;
            Ok(CellPlan {
                outage: policy(&location),
                location,
                cell_kubeconfig,
                hub_kubeconfig,
            })
        })
        .collect()
}

/// Parses a sweep interval: a duration of at least one second (each sweep confirms every orphan
/// with a cell read; a shorter interval would only busy the cells).
///
/// # Errors
/// As [`parse_duration`], or a message for intervals under a second.
pub fn parse_sweep_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!("--sweep-interval {s:?} must be at least 1s"));
    }
    Ok(d)
}

/// Checks the flag combinations of `replicator run` that clap cannot: each location once, a
/// `--withdraw-unreachable-after` location served, the Lease timing.
///
/// # Errors
/// The message of the first that fails, for [`usage_error`].
pub fn check(args: &RunArgs) -> Result<(), String> {
    cells(args).map_err(|err| format!("{err:#}"))?;
    if args.leader_elect {
        election::check_timing(args.lease_duration, args.lease_grace)?;
    }
    Ok(())
}

/// A usage error of `subcommand` with `message`, as clap reports its own: the message, the
/// subcommand's usage line and a hint to `--help`, exit status 2.
pub fn usage_error(subcommand: &str, message: impl std::fmt::Display) -> clap::Error {
    use clap::CommandFactory;
    let mut command = Cli::command();
    command.build();
    match command.find_subcommand_mut(subcommand) {
        Some(sub) => sub.error(clap::error::ErrorKind::ValueValidation, message),
        None => command.error(clap::error::ErrorKind::ValueValidation, message),
    }
}

/// Exit status of a run that failed after its flags were accepted.
pub const EXIT_FAILURE: u8 = 1;
/// Exit status of a usage error: a bad flag, flag value or combination of flags (clap's own).
pub const EXIT_USAGE: u8 = 2;

/// How a command ended, for its exit status ([`Outcome::exit_code`]).
#[derive(Debug)]
pub enum Outcome {
    /// Done: exit status 0.
    Success,
    /// The command line was refused ([`EXIT_USAGE`]), or `--help`/`--version` was asked for
    /// (0): clap's error, printed as clap prints it.
    Usage(clap::Error),
    /// The command failed while running ([`EXIT_FAILURE`]), reported once by
    /// [`crate::logging::fatal`] as `<command> failed`.
    Failure {
        /// The command, e.g. `replicator run`.
        command: &'static str,
        /// What failed, with its causes.
        error: anyhow::Error,
    },
}

impl Outcome {
    /// The outcome of `command` returning `result`.
    pub fn of(command: &'static str, result: anyhow::Result<()>) -> Self {
        match result {
            Ok(()) => Self::Success,
            Err(error) => Self::Failure { command, error },
        }
    }

    /// The process exit status: 0 on success (and for `--help`, `--version`), [`EXIT_USAGE`] for
    /// a usage error, [`EXIT_FAILURE`] for a runtime failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Success => 0,
            Self::Usage(err) => u8::try_from(err.exit_code()).unwrap_or(EXIT_USAGE),
            Self::Failure { .. } => EXIT_FAILURE,
        }
    }

    /// Reports the outcome once, on stderr: clap's text for a usage error (help and version on
    /// stdout), the fatal line for a failure (JSON under `--log-format json`).
    pub fn report(&self) {
        match self {
            Self::Success => {}
            Self::Usage(err) => {
                let _ = err.print();
            }
            Self::Failure { command, error } => crate::logging::fatal(command, error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::LogFormat;

    fn run_args(argv: &[&str]) -> Result<RunArgs, clap::Error> {
        let cli = Cli::try_parse_from(["replicator", "run", "--hub-kubeconfig", "/hub"].iter().chain(argv))?;
        match cli.command {
            Command::Run(args) => Ok(*args),
            _ => unreachable!("parsed run"),
        }
    }

    #[test]
    fn echo_bookkeeping_is_on_unless_turned_off_and_hidden_from_help() {
        assert!(run_args(&["--location", "dfw"]).unwrap().echo_bookkeeping);
        assert!(
            !run_args(&["--location", "dfw", "--echo-bookkeeping=false"])
                .unwrap()
                .echo_bookkeeping
        );
        let help = match Cli::try_parse_from(["replicator", "run", "--help"]) {
            Err(e) => e.to_string(),
            Ok(_) => String::new(),
        };
        assert!(help.contains("--workers"), "{help}");
        assert!(
            !help.contains("echo-bookkeeping"),
            "a measuring switch, not an operator's flag"
        );
    }

    #[test]
    fn version_names_the_crate_version_and_commit() {
        let printed = match Cli::try_parse_from(["replicator", "--version"]) {
            Err(err) if err.kind() == clap::error::ErrorKind::DisplayVersion => err.to_string(),
            other => panic!("--version printed no version: {other:?}"),
        };
        assert_eq!(printed.trim_end(), format!("replicator {VERSION}"));
        let commit = VERSION
            .strip_prefix(concat!(env!("CARGO_PKG_VERSION"), " (commit "))
            .and_then(|rest| rest.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{VERSION:?} is not `<version> (commit <commit>)`"));
        let short_hex =
            (7..=12).contains(&commit.len()) && commit.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        assert!(
            short_hex || commit == "unknown",
            "commit {commit:?}: 7 to 12 lowercase hex digits or unknown"
        );
    }

    #[test]
    fn one_cell_or_many() -> anyhow::Result<()> {
        let single = run_args(&["--location", "dfw"])?;
        assert_eq!(
            cells(&single)?,
            vec![CellPlan {
                location: "dfw".to_owned(),
                cell_kubeconfig: None,
                hub_kubeconfig: PathBuf::from("/hub"),
                outage: outage::Policy::Keep
            }]
        );
        assert!(single.leader_elect, "leader election is on by default");

        let many = run_args(&[
            "--cell",
            "dfw=/k/a",
            "--cell",
            "sjc=/k/b",
            "--withdraw-unreachable-after",
            "10m",
            "--withdraw-unreachable-after",
            "sjc=30s",
            "--leader-elect=false",
        ])?;
        assert!(!many.leader_elect);
        assert_eq!(
            cells(&many)?,
            vec![
                CellPlan {
                    location: "dfw".to_owned(),
                    cell_kubeconfig: Some(PathBuf::from("/k/a")),
                    hub_kubeconfig: PathBuf::from("/hub"),
                    outage: outage::Policy::WithdrawAfter(Duration::from_secs(600))
                },
                CellPlan {
                    location: "sjc".to_owned(),
                    cell_kubeconfig: Some(PathBuf::from("/k/b")),
                    hub_kubeconfig: PathBuf::from("/hub"),
                    outage: outage::Policy::WithdrawAfter(Duration::from_secs(30))
                },
            ]
        );
        Ok(())
    }

    /// Issue #18: each location writes to the hub as its own identity, so a process serving
    /// several cells takes a hub kubeconfig per location.
    #[test]
    fn each_cell_may_have_its_own_hub_kubeconfig() -> anyhow::Result<()> {
        let parse = |argv: &[&str]| -> Result<RunArgs, clap::Error> {
            match Cli::try_parse_from(["replicator", "run"].iter().chain(argv))?.command {
                Command::Run(args) => Ok(*args),
                _ => unreachable!("parsed run"),
            }
        };
        let own = parse(&[
            "--cell",
            "dfw=/k/a",
            "--cell",
            "sjc=/k/b",
            "--cell-hub-kubeconfig",
            "dfw=/hub/dfw",
            "--cell-hub-kubeconfig",
            "sjc=/hub/sjc",
        ])?;
        let hubs: Vec<(String, PathBuf)> = cells(&own)?
            .into_iter()
            .map(|c| (c.location, c.hub_kubeconfig))
            .collect();
        assert_eq!(
            hubs,
            vec![
                ("dfw".to_owned(), PathBuf::from("/hub/dfw")),
                ("sjc".to_owned(), PathBuf::from("/hub/sjc"))
            ]
        );
        let fallback = parse(&[
            "--cell",
            "dfw=/k/a",
            "--cell",
            "sjc=/k/b",
            "--cell-hub-kubeconfig",
            "dfw=/hub/dfw",
            "--hub-kubeconfig",
            "/hub/shared",
        ])?;
        let hubs: Vec<PathBuf> = cells(&fallback)?.into_iter().map(|c| c.hub_kubeconfig).collect();
        assert_eq!(hubs, vec![PathBuf::from("/hub/dfw"), PathBuf::from("/hub/shared")]);

        let missing = parse(&[
            "--cell",
            "dfw=/k/a",
            "--cell",
            "sjc=/k/b",
            "--cell-hub-kubeconfig",
            "dfw=/h",
        ])?;
        assert_eq!(
            cells(&missing).unwrap_err().to_string(),
            "cell \"sjc\" has no hub kubeconfig: give --cell-hub-kubeconfig sjc=PATH or --hub-kubeconfig"
        );
        let stray = parse(&["--cell", "dfw=/k/a", "--cell-hub-kubeconfig", "ord=/h"])?;
        assert!(cells(&stray).unwrap_err().to_string().contains("does not serve"));
        let twice = parse(&[
            "--cell",
            "dfw=/k/a",
            "--cell-hub-kubeconfig",
            "dfw=/h",
            "--cell-hub-kubeconfig",
            "dfw=/i",
        ])?;
        assert!(cells(&twice).unwrap_err().to_string().contains("twice"));
        assert!(
            parse(&["--location", "dfw"]).is_err(),
            "--hub-kubeconfig is required alone"
        );
        assert!(
            parse(&[
                "--location",
                "dfw",
                "--hub-kubeconfig",
                "/h",
                "--cell-hub-kubeconfig",
                "dfw=/h"
            ])
            .is_err(),
            "--cell-hub-kubeconfig goes with --cell"
        );
        Ok(())
    }

    /// `replicator-membership` is the membership controller's hub identity: no location may
    /// take that name (config/rbac/hub/admission_policy.yaml).
    #[test]
    fn the_membership_location_is_reserved() {
        for argv in [&["--location", "membership"][..], &["--cell", "membership=/k"][..]] {
            let err = run_args(argv).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{argv:?}");
            assert!(
                err.to_string().contains(
                    "\"membership\" is reserved: its hub identity replicator-membership is the membership controller's"
                ),
                "{err}"
            );
        }
        assert_eq!(parse_location("membership-2"), Ok("membership-2".to_owned()));
    }

    #[test]
    fn bad_cells_are_refused_with_the_reason() -> anyhow::Result<()> {
        assert!(run_args(&[]).is_err(), "a location or a cell is required");
        assert!(
            run_args(&["--location", "dfw", "--cell", "sjc=/k"]).is_err(),
            "not both"
        );
        assert!(parse_cell("dfw").unwrap_err().contains("LOCATION=KUBECONFIG"));
        assert!(parse_cell("DFW=/k").unwrap_err().contains("DNS label"));
        assert!(parse_cell("dfw=").unwrap_err().contains("empty"));
        assert!(parse_withdraw("5s").unwrap_err().contains("at least 10s"));
        assert!(parse_withdraw("Bad=1m").is_err());
        assert_eq!(
            parse_withdraw("dfw=1m"),
            Ok((Some("dfw".into()), Duration::from_secs(60)))
        );
        let twice = run_args(&["--cell", "dfw=/a", "--cell", "dfw=/b"])?;
        assert!(cells(&twice).unwrap_err().to_string().contains("twice"));
        let stray = run_args(&["--cell", "dfw=/a", "--withdraw-unreachable-after", "ord=1m"])?;
        assert!(cells(&stray).unwrap_err().to_string().contains("does not serve"));
        let upper = run_args(&["--location", "DFW_1"]).unwrap_err();
        assert_eq!(upper.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(
            upper
                .to_string()
                .contains(r#"invalid value 'DFW_1' for '--location <LOCATION>': "DFW_1" is not a DNS label"#),
            "{upper}"
        );
        assert_eq!(parse_location("dfw-2"), Ok("dfw-2".to_owned()));
        assert!(parse_location(&"a".repeat(64)).is_err());
        let policies = Cli::try_parse_from(["replicator", "policies", "--location", "dfw", "--location", "Sjc"]);
        assert_eq!(
            policies.map(|_| ()).unwrap_err().kind(),
            clap::error::ErrorKind::ValueValidation
        );
        Ok(())
    }

    #[test]
    fn usage_errors_exit_2_and_failures_exit_1() -> anyhow::Result<()> {
        let usage = |argv: &[&str]| match Cli::try_parse_from(argv) {
            Err(err) => Outcome::Usage(err),
            Ok(cli) => panic!("{argv:?} parsed: {cli:?}"),
        };
        let bad_value = usage(&["replicator", "run", "--hub-kubeconfig", "/h", "--location", "DFW_1"]);
        assert_eq!(bad_value.exit_code(), 2);
        assert_eq!(
            usage(&["replicator", "run", "--location", "dfw"]).exit_code(),
            2,
            "missing flag"
        );
        assert_eq!(usage(&["replicator", "run", "--bogus"]).exit_code(), 2, "unknown flag");
        assert_eq!(
            usage(&[
                "replicator",
                "run",
                "--hub-kubeconfig",
                "/h",
                "--location",
                "dfw",
                "--lease-duration",
                "5x"
            ])
            .exit_code(),
            2
        );
        assert_eq!(usage(&["replicator", "--help"]).exit_code(), 0);
        assert_eq!(usage(&["replicator", "--version"]).exit_code(), 0);

        // Combinations clap cannot check are usage errors too, with the subcommand's usage.
        let twice = run_args(&["--cell", "dfw=/a", "--cell", "dfw=/b"])?;
        let message = check(&twice).unwrap_err();
        assert_eq!(message, "location \"dfw\" is given twice: each location is one cell");
        let err = usage_error("run", message);
        let text = err.to_string();
        assert_eq!(Outcome::Usage(err).exit_code(), EXIT_USAGE);
        assert!(text.starts_with("error: location \"dfw\" is given twice"), "{text}");
        assert!(text.contains("Usage: replicator run [OPTIONS]"), "{text}");
        let timing = run_args(&["--location", "dfw", "--lease-duration", "5s", "--lease-grace", "5s"])?;
        assert_eq!(
            check(&timing),
            Err("--lease-grace (5s) must be shorter than --lease-duration (5s)".to_owned())
        );
        assert_eq!(check(&run_args(&["--location", "dfw"])?), Ok(()));

        let failed = Outcome::of("replicator run", Err(anyhow::anyhow!("hub unreachable")));
        assert_eq!(failed.exit_code(), EXIT_FAILURE);
        assert_eq!(EXIT_FAILURE, 1);
        assert_eq!(Outcome::of("replicator run", Ok(())).exit_code(), 0);
        Ok(())
    }

    #[test]
    fn the_log_level_flag_takes_a_level_or_directives() -> anyhow::Result<()> {
        let plain = run_args(&["--location", "dfw"])?;
        assert_eq!(plain.log.log_level, None);
        assert_eq!(plain.log.log_format, LogFormat::Text);
        let debug = run_args(&["--location", "dfw", "--log-level", "debug", "--log-format", "json"])?;
        assert_eq!(debug.log.log_level.as_deref(), Some("debug"));
        assert_eq!(debug.log.log_format, LogFormat::Json);
        let directives = run_args(&["--location", "dfw", "--log-level", "replicator=debug,kube=info"])?;
        assert_eq!(directives.log.log_level.as_deref(), Some("replicator=debug,kube=info"));
        let bad = run_args(&["--location", "dfw", "--log-level", "loud"]).unwrap_err();
        assert_eq!(bad.kind(), clap::error::ErrorKind::ValueValidation);
        let membership = Cli::try_parse_from([
            "replicator",
            "membership",
            "--hub-kubeconfig",
            "/h",
            "--log-level",
            "warn",
        ])?;
        match membership.command {
            Command::Membership(args) => assert_eq!(args.log.log_level.as_deref(), Some("warn")),
            other => panic!("{other:?}"),
        }
        let mut help = Vec::new();
        {
            use clap::CommandFactory;
            let mut command = Cli::command();
            command.build();
            let run = command.find_subcommand_mut("run").unwrap();
            run.write_long_help(&mut help)?;
        }
        let help = String::from_utf8(help)?;
        assert!(help.contains("--log-level <LEVEL|DIRECTIVES>"), "{help}");
        assert!(
            help.contains("RUST_LOG sets the same; this flag wins when both are given"),
            "{help}"
        );
        Ok(())
    }

    #[test]
    fn flag_values_parse_and_are_checked() {
        assert!(parse_sweep_interval("0").is_err());
        assert_eq!(
            parse_sweep_interval("500ms"),
            Err("--sweep-interval \"500ms\" must be at least 1s".to_owned())
        );
        assert_eq!(parse_sweep_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_sweep_interval("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(
            parse_withdraw("dfw=1m30s"),
            Ok((Some("dfw".into()), Duration::from_secs(90)))
        );
        assert_eq!(
            parse_withdraw("9s"),
            Err("--withdraw-unreachable-after \"9s\" must be at least 10s".to_owned())
        );
        let run = run_args(&[
            "--location",
            "dfw",
            "--lease-duration",
            "1m",
            "--sweep-interval",
            "1h30m",
        ])
        .unwrap();
        assert_eq!(run.lease_duration, Duration::from_secs(60));
        assert_eq!(run.sweep_interval, Duration::from_secs(5400));
    }
}
