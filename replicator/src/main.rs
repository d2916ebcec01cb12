//! The `replicator` binary: see `replicator --help`.
//!
//! Exit status: 0 on success, 2 for a usage error (a bad flag, flag value or combination, printed
//! by clap with the usage), 1 for a failure while running (reported once: a log line, JSON under
//! `--log-format json`, for `run` and `membership`; `replicator <command>: <error>` otherwise).

use std::process::ExitCode;

use clap::Parser;
use replicator::cli::{self, Cli, Command, Outcome};

#[tokio::main]
async fn main() -> ExitCode {
    let outcome = match Cli::try_parse() {
        Ok(cli) => dispatch(cli).await,
        Err(usage) => Outcome::Usage(usage),
    };
    outcome.report();
    ExitCode::from(outcome.exit_code())
}

async fn dispatch(cli: Cli) -> Outcome {
    match cli.command {
        Command::Crds => Outcome::of(
            "replicator crds",
            replicator::api::crds_yaml()
                .map(|yaml| print!("{yaml}"))
                .map_err(Into::into),
        ),
        Command::Policies { locations } => Outcome::of(
            "replicator policies",
            replicator::policies::render(&locations)
                .map(|yaml| print!("{yaml}"))
                .map_err(Into::into),
        ),
        // An operator's command: one clear line and exit status 1, never a backtrace.
        Command::Status(args) => Outcome::of("replicator status", replicator::status::run(args).await),
        Command::Membership(args) => {
            if let Err(error) = replicator::runtime::init_logging(&args.log) {
                return Outcome::of("replicator membership", Err(error));
            }
            Outcome::of("replicator membership", replicator::membership::run(args).await)
        }
        Command::Run(args) => {
            if let Err(message) = cli::check(&args) {
                return Outcome::Usage(cli::usage_error("run", message));
            }
            if let Err(error) = replicator::runtime::init_logging(&args.log) {
                return Outcome::of("replicator run", Err(error));
            }
            Outcome::of("replicator run", cli::run(*args).await)
        }
    }
}
