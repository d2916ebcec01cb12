//! Writing the harness's files and command lines: files only their owner may read (kubeconfigs
//! and keys hold secrets) and `--name=value` flags whose values may be paths.

use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use crate::error::{Result, io_context};

/// Writes a file readable only by its owner (kubeconfigs hold tokens).
pub fn write_private(path: &Path, contents: &str) -> Result<()> {
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io_context(format!("opening {}", path.display())))?;
    file.write_all(contents.as_bytes())
        .map_err(io_context(format!("writing {}", path.display())))
}

/// `--name=value` as an OS string (values may be paths).
pub fn flag(name: &str, value: impl AsRef<OsStr>) -> OsString {
    let mut flag = OsString::from(name);
    flag.push("=");
    flag.push(value);
    flag
}
