//! Running short-lived helper commands (openssl, kubectl) and reporting their failures.

use std::process::Output;

use tokio::process::Command;

use crate::error::{Error, Result, io_context};

/// A printable form of a command line, for error messages.
pub(crate) fn describe(command: &Command) -> String {
    let std = command.as_std();
    std::iter::once(std.get_program())
        .chain(std.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command to completion, capturing its output; fails unless it exits successfully.
pub(crate) async fn run_checked(command: &mut Command) -> Result<Output> {
    let output = run(command).await?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(Error::CommandFailed {
            command: describe(command),
            status: output.status,
            output: combined_output(&output),
        })
    }
}

/// Runs a command to completion and returns its output whatever its exit status.
pub(crate) async fn run(command: &mut Command) -> Result<Output> {
    command.stdin(std::process::Stdio::null());
    command
        .output()
        .await
        .map_err(io_context(format!("running `{}`", describe(command))))
}

/// Runs a command with its output streamed to this process's stdout and stderr (a build script
/// whose progress a person watches); fails unless it exits successfully.
pub(crate) async fn run_streamed(command: &mut Command) -> Result<()> {
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::inherit())
        .stderr(std::process::Stdio::inherit());
    let status = command
        .status()
        .await
        .map_err(io_context(format!("running `{}`", describe(command))))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::CommandFailed {
            command: describe(command),
            status,
            output: "(its output was streamed above)".to_owned(),
        })
    }
}

/// stderr followed by stdout, lossily decoded, for error messages.
pub(crate) fn combined_output(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    match (stderr.trim().is_empty(), stdout.trim().is_empty()) {
        (false, false) => format!("{}\n{}", stderr.trim_end(), stdout.trim_end()),
        (false, true) => stderr.trim_end().to_owned(),
        (true, false) => stdout.trim_end().to_owned(),
        (true, true) => "(no output)".to_owned(),
    }
}
