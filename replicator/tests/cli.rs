//! The built `replicator` binary's exit statuses and stderr: usage errors exit 2 with clap's
//! text, runtime failures exit 1 with one fatal line (JSON under `--log-format json`), colours
//! never reach a pipe. No cluster is needed: every run here fails before reaching one.

#![cfg(test)]

use std::process::{Command, Output};

fn replicator(args: &[&str], rust_log: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_replicator"));
    command
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .env_remove("REPLICATOR_LOCATION")
        .env_remove("REPLICATOR_RULES")
        .env_remove("REPLICATOR_LOG_FORMAT")
        .env_remove("KUBERNETES_SERVICE_HOST");
    if let Some(filter) = rust_log {
        command.env("RUST_LOG", filter);
    }
    command.output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

/// `replicator run` failing while running: its rules file does not exist (read before any
/// address is bound or cluster reached).
const FAILING_RUN: [&str; 8] = [
    "run",
    "--hub-kubeconfig",
    "/nonexistent/hub.kubeconfig",
    "--location",
    "dfw",
    "--rules",
    "/nonexistent/rules.yaml",
    "--leader-elect=true",
];

#[test]
fn a_bad_flag_value_is_a_usage_error() {
    let out = replicator(
        &[
            "run",
            "--hub-kubeconfig",
            "/h",
            "--location",
            "DFW_1",
            "--log-format",
            "json",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let text = stderr(&out);
    assert!(
        text.starts_with("error: invalid value 'DFW_1' for '--location <LOCATION>': \"DFW_1\" is not a DNS label"),
        "{text}"
    );
    assert!(text.contains("--help"), "{text}");
    assert!(out.stdout.is_empty());

    let out = replicator(
        &["run", "--hub-kubeconfig", "/h", "--cell", "dfw=/a", "--cell", "dfw=/b"],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let text = stderr(&out);
    assert!(text.contains("location \"dfw\" is given twice"), "{text}");
    assert!(text.contains("Usage: replicator run"), "{text}");

    let out = replicator(
        &[
            "run",
            "--hub-kubeconfig",
            "/h",
            "--location",
            "dfw",
            "--sweep-interval",
            "1m30",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn a_runtime_failure_is_one_json_line_and_exit_1() {
    let mut args = FAILING_RUN.to_vec();
    args.extend(["--log-format", "json"]);
    let out = replicator(&args, None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = stderr(&out);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}")))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    let fatal = &lines[0];
    assert_eq!(fatal["level"], "ERROR");
    assert_eq!(fatal["message"], "replicator run failed");
    let error = fatal["error"].as_str().unwrap();
    assert!(
        error.starts_with("failed to read rules file /nonexistent/rules.yaml: "),
        "{error}"
    );
    assert_eq!(error.matches("No such file").count(), 1, "each cause once: {error}");
    assert!(out.stdout.is_empty());
}

#[test]
fn text_lines_on_a_pipe_have_no_colour_and_the_error_shows_once() {
    let out = replicator(&FAILING_RUN, None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = stderr(&out);
    assert!(!text.contains('\u{1b}'), "ANSI escapes reached a pipe: {text:?}");
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("ERROR"), "{text}");
    assert!(text.contains("replicator run failed"), "{text}");
    assert_eq!(text.matches("failed to read rules file").count(), 1, "{text}");
    assert!(!text.contains("Error:"), "no second report from main: {text}");
}

#[test]
fn the_fatal_line_shows_whatever_the_filter_and_the_flag_wins_over_rust_log() {
    let out = replicator(&FAILING_RUN, Some("off"));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr(&out).matches("replicator run failed").count(), 1, "{out:?}");

    // An invalid RUST_LOG is reported (and the default used) when it is in force ...
    let out = replicator(&FAILING_RUN, Some("replicator=loud"));
    let text = stderr(&out);
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(
        text.contains("RUST_LOG=\"replicator=loud\" is not a valid filter"),
        "{text}"
    );
    // ... and not looked at when --log-level is given.
    let mut args = FAILING_RUN.to_vec();
    args.extend(["--log-level", "info"]);
    let out = replicator(&args, Some("replicator=loud"));
    let text = stderr(&out);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("replicator run failed"), "{text}");
}

#[test]
fn status_failures_and_help_keep_their_codes() {
    let out = replicator(&["status", "--hub-kubeconfig", "/nonexistent/hub.kubeconfig"], None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = stderr(&out);
    assert!(text.starts_with("replicator status: "), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");

    let out = replicator(&["--help"], None);
    assert_eq!(out.status.code(), Some(0));
    let out = replicator(&["run", "--help"], None);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("--log-level <LEVEL|DIRECTIVES>"), "{help}");
    assert!(help.contains("RUST_LOG"), "{help}");
}
