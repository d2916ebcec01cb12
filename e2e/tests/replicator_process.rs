//! `ReplicatorProcess` against a stand-in binary: the command line it builds, its log file, and
//! how it reports a process that exits instead of becoming ready.

use std::os::unix::fs::PermissionsExt as _;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use replicator_e2e::{CELL_B, Environment, Error, HUB, ReplicatorProcess, ReplicatorSpec};

#[tokio::test]
async fn a_replicator_that_exits_fails_wait_ready_fast_with_its_log() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let fake = env.dir().join(format!("fake-replicator-{}.sh", std::process::id()));
    std::fs::write(&fake, "#!/bin/sh\necho \"fake replicator: $*\"\nexit 3\n")?;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755))?;

    let spec = ReplicatorSpec::new(CELL_B)
        .binary(&fake)
        .location("west")
        .args(["--resync-period", "5s"]);
    let mut replicator = ReplicatorProcess::spawn(&env, spec).await?;
    let started = Instant::now();
    let result = replicator.wait_ready(Duration::from_secs(60)).await;
    ensure!(
        started.elapsed() < Duration::from_secs(20),
        "wait_ready did not notice the exit quickly"
    );
    match result {
        Err(Error::NotReady { reason, log_tail, .. }) => {
            ensure!(matches!(*reason, Error::Aborted { .. }), "{reason}");
            ensure!(log_tail.contains("fake replicator: run --location west"), "{log_tail}");
        }
        other => anyhow::bail!("expected NotReady, got {other:?}"),
    }
    let status = replicator.kill().await?;
    ensure!(status.code() == Some(3), "exit status {status}");

    let log = std::fs::read_to_string(replicator.log_path())?;
    // By default the process runs as the least-privilege service accounts, never as admin: on
    // the hub as its location's identity, replicator-west.
    let ids = env.least_privilege().await?;
    let expected = [
        format!("--cell-kubeconfig {}", ids.cell_kubeconfig(CELL_B)?.display()),
        format!(
            "--hub-kubeconfig {}",
            ids.hub_kubeconfig_for(&env, "west").await?.display()
        ),
        "--metrics-bind-address 127.0.0.1:".to_owned(),
        "--health-probe-bind-address 127.0.0.1:".to_owned(),
        "--resync-period 5s".to_owned(),
    ];
    for part in expected {
        ensure!(log.contains(&part), "log lacks {part:?}:\n{log}");
    }
    for admin in [env.kubeconfig_path(CELL_B), env.kubeconfig_path(HUB)] {
        ensure!(
            !log.contains(&admin.display().to_string()),
            "admin kubeconfig {} passed by default:\n{log}",
            admin.display()
        );
    }
    ensure!(
        replicator
            .log_path()
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("replicator-west-")),
        "log file {}",
        replicator.log_path().display()
    );
    ensure!(replicator.metrics_url().starts_with("http://127.0.0.1:"));
    std::fs::remove_file(&fake).context("removing the fake binary")?;
    Ok(())
}

#[tokio::test]
async fn a_missing_binary_says_how_to_build_it() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let spec = ReplicatorSpec::new(CELL_B).binary(env.dir().join("no-such-replicator"));
    match ReplicatorProcess::spawn(&env, spec).await {
        Err(error @ Error::ReplicatorBinaryMissing(_)) => {
            ensure!(error.to_string().contains("cargo build -p replicator"), "{error}");
            Ok(())
        }
        other => anyhow::bail!("expected ReplicatorBinaryMissing, got {other:?}"),
    }
}
