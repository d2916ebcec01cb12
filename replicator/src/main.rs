//! The `replicator` binary: see `replicator --help`.

use clap::Parser;
use replicator::cli::{self, Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds => {
            print!("{}", replicator::api::crds_yaml()?);
            Ok(())
        }
        Command::Policies { locations } => {
            print!("{}", replicator::policies::render(&locations)?);
            Ok(())
        }
        Command::Status(args) => {
            // An operator's command: one clear line and exit status 1, never a backtrace.
            if let Err(err) = replicator::status::run(args).await {
                eprintln!("replicator status: {err:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Membership(args) => {
            cli::init_tracing(args.log_format);
            replicator::membership::run(args)
                .await
                .inspect_err(|err| tracing::error!(error = format!("{err:#}"), "replicator membership failed"))
        }
        Command::Run(args) => {
            cli::init_tracing(args.log_format);
            cli::run(*args)
                .await
                .inspect_err(|err| tracing::error!(error = format!("{err:#}"), "replicator failed"))
        }
    }
}
