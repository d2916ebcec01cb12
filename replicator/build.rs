//! Records the git commit the binary is built from, for `replicator --version`.
//!
//! Sets `REPLICATOR_BUILD_COMMIT` for the crate: `REPLICATOR_GIT_COMMIT` when set (a build
//! without a git checkout, e.g. from a source archive, passes the commit that way), else
//! `git rev-parse --short=12 HEAD`, else `unknown`. Either way it is 7 to 12 lowercase hex digits
//! or `unknown`. Cargo reruns this script when HEAD moves (a commit, a checkout): it watches
//! HEAD, the loose refs and `packed-refs`.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const OVERRIDE: &str = "REPLICATOR_GIT_COMMIT";
const UNKNOWN: &str = "unknown";
/// Characters of the commit kept: `git rev-parse --short=12`.
const SHORT: usize = 12;

fn main() -> Result<(), String> {
    println!("cargo:rerun-if-env-changed={OVERRIDE}");
    let commit = match env::var(OVERRIDE) {
        Ok(given) => normalize(&given)
            .ok_or_else(|| format!("{OVERRIDE}={given:?}: expected a commit (7 to 40 hex digits) or {UNKNOWN:?}"))?,
        Err(_) => {
            watch_git();
            git(&["rev-parse", &format!("--short={SHORT}"), "HEAD"])
                .and_then(|out| normalize(&out))
                .unwrap_or_else(|| UNKNOWN.to_owned())
        }
    };
    println!("cargo:rustc-env=REPLICATOR_BUILD_COMMIT={commit}");
    Ok(())
}

/// `unknown`, or a commit cut to [`SHORT`] lowercase hex digits; `None` for anything else.
fn normalize(commit: &str) -> Option<String> {
    let commit = commit.trim();
    if commit == UNKNOWN {
        return Some(commit.to_owned());
    }
    let hex = (7..=40).contains(&commit.len()) && commit.bytes().all(|b| b.is_ascii_hexdigit());
    hex.then(|| commit[..commit.len().min(SHORT)].to_ascii_lowercase())
}

/// Output of a successful git command, trimmed; `None` without git or outside a checkout.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_owned())
}

/// Reruns the script when HEAD or a ref changes. Only existing paths are named: Cargo reruns a
/// script on every build when a watched path is missing.
fn watch_git() {
    // A worktree has its own HEAD (git dir) but shares refs (common dir).
    let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]).map(PathBuf::from) else {
        return;
    };
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])
        .map(PathBuf::from)
        .unwrap_or_else(|| git_dir.clone());
    // `refs/heads` is a directory: Cargo watches every file under it (a new or moved branch).
    let paths = [
        git_dir.join("HEAD"),
        common.join("refs").join("heads"),
        common.join("packed-refs"),
    ];
    for path in paths.iter().filter(|path| Path::exists(path)) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
