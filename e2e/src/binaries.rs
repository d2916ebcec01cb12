//! The control-plane binaries, built by `e2e/scripts/build-control-plane.sh` into a cache, and
//! the Karmada manifests the script copies next to the Karmada binaries; also Prometheus and
//! promtool, which the monitoring checks run (`e2e/tests/monitoring.rs`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::process::Command;

use crate::command::run_streamed;
use crate::error::{Error, Result};
use crate::paths;

/// The etcd version the harness runs.
pub const ETCD_VERSION: &str = "v3.6.16";
/// The Kubernetes version the harness runs (kube-apiserver, kube-controller-manager,
/// kube-scheduler, kubelet, kubectl).
pub const KUBE_VERSION: &str = "v1.35.4";
/// The Karmada version the harness runs (aggregated apiserver, webhook, controller-manager,
/// scheduler). v1.19.0 is not on the module proxy; v1.18.2 pairs with Kubernetes 1.35.
pub const KARMADA_VERSION: &str = "v1.18.2";
/// The version of the `github.com/prometheus/prometheus` Go module the harness builds
/// `prometheus` and `promtool` from: Prometheus 3.x tags it `v0.<major*100+minor>.<patch>`.
pub const PROMETHEUS_VERSION: &str = "v0.316.0";
/// The Prometheus release [`PROMETHEUS_VERSION`] is (what `--version` prints).
pub const PROMETHEUS_RELEASE: &str = "3.16.0";

/// Paths of the control-plane binaries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binaries {
    /// etcd.
    pub etcd: PathBuf,
    /// kube-apiserver.
    pub kube_apiserver: PathBuf,
    /// kube-controller-manager.
    pub kube_controller_manager: PathBuf,
    /// kube-scheduler (the cells').
    pub kube_scheduler: PathBuf,
    /// kubelet (the cells').
    pub kubelet: PathBuf,
    /// kubectl.
    pub kubectl: PathBuf,
    /// karmada-aggregated-apiserver (serves `cluster.karmada.io`).
    pub karmada_aggregated_apiserver: PathBuf,
    /// karmada-webhook.
    pub karmada_webhook: PathBuf,
    /// karmada-controller-manager.
    pub karmada_controller_manager: PathBuf,
    /// karmada-scheduler.
    pub karmada_scheduler: PathBuf,
    /// Karmada's CRDs (`charts/karmada/_crds/bases`, flattened): a directory of YAML files.
    pub karmada_crds: PathBuf,
    /// Karmada's `artifacts/deploy/webhook-configuration.yaml` (with its placeholders).
    pub karmada_webhook_configuration: PathBuf,
    /// prometheus (a bare server the monitoring scenario runs; no web UI, the HTTP API works).
    /// A state file written before it joined the set reads as the cache's path.
    #[serde(default = "expected_prometheus")]
    pub prometheus: PathBuf,
    /// promtool (rule unit tests, `check rules`, `check metrics`).
    #[serde(default = "expected_promtool")]
    pub promtool: PathBuf,
}

fn expected_prometheus() -> PathBuf {
    Binaries::expected().prometheus
}

fn expected_promtool() -> PathBuf {
    Binaries::expected().promtool
}

impl Binaries {
    /// Where the build script puts the pinned versions inside `cache`.
    pub fn in_cache(cache: &Path) -> Binaries {
        let bin = cache.join("bin");
        let kube = bin.join(format!("kubernetes-{KUBE_VERSION}"));
        let karmada = bin.join(format!("karmada-{KARMADA_VERSION}"));
        let prometheus = bin.join(format!("prometheus-{PROMETHEUS_VERSION}"));
        Binaries {
            etcd: bin.join(format!("etcd-{ETCD_VERSION}")).join("etcd"),
            kube_apiserver: kube.join("kube-apiserver"),
            kube_controller_manager: kube.join("kube-controller-manager"),
            kube_scheduler: kube.join("kube-scheduler"),
            kubelet: kube.join("kubelet"),
            kubectl: kube.join("kubectl"),
            karmada_aggregated_apiserver: karmada.join("karmada-aggregated-apiserver"),
            karmada_webhook: karmada.join("karmada-webhook"),
            karmada_controller_manager: karmada.join("karmada-controller-manager"),
            karmada_scheduler: karmada.join("karmada-scheduler"),
            karmada_crds: karmada.join("crds"),
            karmada_webhook_configuration: karmada.join("webhook-configuration.yaml"),
            prometheus: prometheus.join("prometheus"),
            promtool: prometheus.join("promtool"),
        }
    }

    /// Where the binaries are expected in the default cache ([`paths::cache_dir`]).
    pub fn expected() -> Binaries {
        Binaries::in_cache(&paths::cache_dir())
    }

    /// The paths of the twelve executables and of the webhook configuration (every file).
    pub fn all(&self) -> [&Path; 13] {
        [
            &self.etcd,
            &self.kube_apiserver,
            &self.kube_controller_manager,
            &self.kube_scheduler,
            &self.kubelet,
            &self.kubectl,
            &self.karmada_aggregated_apiserver,
            &self.karmada_webhook,
            &self.karmada_controller_manager,
            &self.karmada_scheduler,
            &self.karmada_webhook_configuration,
            &self.prometheus,
            &self.promtool,
        ]
    }

    /// The paths that do not exist yet (files, and the CRD directory).
    pub fn missing(&self) -> Vec<&Path> {
        let mut missing: Vec<&Path> = self.all().into_iter().filter(|path| !path.is_file()).collect();
        if !self.karmada_crds.is_dir() {
            missing.push(&self.karmada_crds);
        }
        missing
    }

    /// Returns the cached binaries, running the build script first (its output streamed to this
    /// process's stdout and stderr) if any is missing.
    pub async fn ensure() -> Result<Binaries> {
        let cache = paths::cache_dir();
        let binaries = Binaries::in_cache(&cache);
        if binaries.missing().is_empty() {
            return Ok(binaries);
        }
        let script = paths::build_script();
        tracing::info!(
            missing = ?binaries.missing(),
            script = %script.display(),
            "control-plane binaries missing; building them (takes a while on a cold cache)"
        );
        run_streamed(
            Command::new("bash")
                .arg(&script)
                .env("REPLICATOR_CACHE", &cache)
                .env("KUBE_VERSION", KUBE_VERSION)
                .env("ETCD_VERSION", ETCD_VERSION)
                .env("KARMADA_VERSION", KARMADA_VERSION)
                .env("PROMETHEUS_VERSION", PROMETHEUS_VERSION),
        )
        .await?;
        if let Some(path) = binaries.missing().first() {
            return Err(Error::BinaryMissing {
                path: path.to_path_buf(),
                script,
            });
        }
        Ok(binaries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prometheus_release_is_the_module_version_read_as_prometheus_tags_it() {
        // v0.<major*100+minor>.<patch>, as the build script reads it for `--version`.
        let (minor, patch) = PROMETHEUS_VERSION
            .strip_prefix("v0.")
            .and_then(|v| v.split_once('.'))
            .unwrap_or_default();
        let minor: u32 = minor.parse().unwrap_or_default();
        assert_eq!(format!("{}.{}.{patch}", minor / 100, minor % 100), PROMETHEUS_RELEASE);
    }

    #[test]
    fn a_state_file_from_before_prometheus_reads_with_the_cache_paths() -> anyhow::Result<()> {
        let expected = Binaries::expected();
        let mut recorded = serde_json::to_value(&expected)?;
        if let Some(fields) = recorded.as_object_mut() {
            fields.remove("prometheus");
            fields.remove("promtool");
        }
        assert_eq!(serde_json::from_value::<Binaries>(recorded)?, expected);
        Ok(())
    }
}
