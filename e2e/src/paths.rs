//! Where things live: the workspace, the state directory, the binary cache, the CRDs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Environment variable naming the state directory.
pub const ENV_DIR_VAR: &str = "REPLICATOR_ENV_DIR";

/// The workspace root (the parent of this crate's manifest directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map_or_else(|| manifest.join(".."), Path::to_path_buf)
}

/// The state directory: `$REPLICATOR_ENV_DIR`, else `<workspace>/target/replicator-env`.
pub fn state_dir() -> PathBuf {
    non_empty_var(ENV_DIR_VAR)
        .map(|dir| absolute(PathBuf::from(dir)))
        .unwrap_or_else(|| workspace_root().join("target").join("replicator-env"))
}

/// Cargo's target directory: `$CARGO_TARGET_DIR`, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    non_empty_var("CARGO_TARGET_DIR")
        .map(|dir| absolute(PathBuf::from(dir)))
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The cache the build script fills:
/// `${REPLICATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/replicator}`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = non_empty_var("REPLICATOR_CACHE") {
        return absolute(PathBuf::from(dir));
    }
    let base = non_empty_var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty_var("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(|| workspace_root().join("target").join("cache"));
    absolute(base).join("replicator")
}

/// The script that builds etcd and the Kubernetes binaries into [`cache_dir`].
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join("build-control-plane.sh")
}

/// The directory whose `*.yaml` files are installed as CRDs into every cluster.
pub fn crds_dir() -> PathBuf {
    workspace_root().join("config").join("crds")
}

/// The value of an environment variable, treating "set but empty" as unset (like `${VAR:-}`).
pub(crate) fn non_empty_var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

/// Makes a path absolute against the current directory (without touching the filesystem).
pub(crate) fn absolute(path: PathBuf) -> PathBuf {
    if path.is_absolute() {
        return path;
    }
    std::path::absolute(&path).unwrap_or(path)
}
