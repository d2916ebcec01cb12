//! Installing the project's CRDs (`config/crds/*.yaml`) into a cluster.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use sha2::{Digest, Sha256};

use crate::cluster::Cluster;
use crate::command::{combined_output, describe};
use crate::error::{Error, Result, io_context};
use crate::wait::{self, Check};

/// How long a CRD may take to become Established.
const ESTABLISHED_DEADLINE: Duration = Duration::from_secs(60);
/// The resource prefix `kubectl -o name` prints for CRDs.
const CRD_NAME_PREFIX: &str = "customresourcedefinition.apiextensions.k8s.io/";

/// The `*.yaml` files of `dir` that contain at least one object, sorted; empty if the
/// directory does not exist.
pub(crate) fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(io_context(format!("listing {}", dir.display()))(error)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(io_context(format!("listing {}", dir.display())))?.path();
        if !path.is_file() || path.extension().is_none_or(|ext| ext != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(io_context(format!("reading {}", path.display())))?;
        // kubectl rejects a file without objects ("no objects passed to apply"); a generator
        // may legitimately leave one empty.
        if has_documents(&text) {
            files.push(path);
        } else {
            tracing::debug!(file = %path.display(), "skipping a CRD file without objects");
        }
    }
    files.sort();
    Ok(files)
}

/// Whether a YAML stream has any content besides comments and document markers.
fn has_documents(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .any(|line| !line.is_empty() && !line.starts_with('#') && line != "---" && line != "...")
}

/// A SHA-256 over the files' names and contents, to notice when they change.
pub(crate) fn digest(files: &[PathBuf]) -> Result<String> {
    let mut hasher = Sha256::new();
    for file in files {
        let contents = std::fs::read(file).map_err(io_context(format!("reading {}", file.display())))?;
        hasher.update(file.to_string_lossy().as_bytes());
        hasher.update([0]);
        hasher.update((contents.len() as u64).to_le_bytes());
        hasher.update(&contents);
    }
    Ok(hasher.finalize().iter().map(|byte| format!("{byte:02x}")).collect())
}

/// The `kubectl` arguments that server-side apply `files` and print the applied objects' names
/// (what [`install`] runs).
pub(crate) fn apply_args(files: &[PathBuf]) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = [
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=replicator-e2e",
        "-o",
        "name",
    ]
    .into_iter()
    .map(Into::into)
    .collect();
    for file in files {
        args.push("-f".into());
        args.push(file.into());
    }
    args
}

/// Runs `apply` (a `kubectl` command with [`apply_args`] against `cluster`), then waits through
/// `client` until every CRD among the applied objects is Established. Returns the CRD names.
pub(crate) async fn install(
    mut apply: tokio::process::Command,
    client: kube::Client,
    cluster: Cluster,
) -> Result<Vec<String>> {
    let command = &mut apply;
    let output = crate::command::run(command).await?;
    if !output.status.success() {
        return Err(Error::CommandFailed {
            command: describe(command),
            status: output.status,
            output: combined_output(&output),
        });
    }
    let names: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.trim().strip_prefix(CRD_NAME_PREFIX))
        .map(str::to_owned)
        .collect();
    let api: Api<CustomResourceDefinition> = Api::all(client);
    for name in &names {
        let what = format!("CRD {name} to be Established in {cluster}");
        wait::until_observed(ESTABLISHED_DEADLINE, &what, || {
            let api = api.clone();
            let name = name.clone();
            async move {
                let crd = api.get(&name).await?;
                let conditions = crd.status.and_then(|status| status.conditions).unwrap_or_default();
                let established = conditions.iter().find(|condition| condition.type_ == "Established");
                Ok::<_, kube::Error>(match established {
                    Some(condition) if condition.status == "True" => Check::Ready(()),
                    Some(condition) => Check::NotYet(format!(
                        "Established={} ({})",
                        condition.status,
                        condition.message.as_deref().unwrap_or("no message")
                    )),
                    None => Check::NotYet("no Established condition yet".to_owned()),
                })
            }
        })
        .await?;
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_streams_have_no_documents() {
        assert!(!has_documents(""));
        assert!(!has_documents("---\n# generated\n...\n\n"));
        assert!(has_documents("---\napiVersion: v1\n"));
    }
}
