//! `state.json`: what a running environment consists of (pids, ports, binaries, token).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::binaries::Binaries;
use crate::cluster::Cluster;
use crate::daemon::Daemon;
use crate::error::{Error, Result, io_context};
use crate::ports::Ports;
use crate::process::ProcessRecord;

/// Bumped whenever the layout changes; a state file of another format is treated as stale.
const FORMAT: u32 = 3;

/// The contents of `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    /// The layout version ([`FORMAT`]).
    pub format: u32,
    /// The ports the environment was started with.
    pub ports: Ports,
    /// The binaries it runs.
    pub binaries: Binaries,
    /// The admin bearer token (also in `pki/tokens.csv` and the kubeconfigs).
    pub admin_token: String,
    /// etcd, once started.
    pub etcd: Option<ProcessRecord>,
    /// One entry per cluster; `process` is `None` while the apiserver is stopped.
    pub apiservers: Vec<ApiserverState>,
    /// kube-controller-manager and the Karmada components, once started.
    pub daemons: BTreeMap<Daemon, ProcessRecord>,
    /// Whether the Karmada members have been registered (the control plane is complete; a
    /// restarted hub must then serve the aggregated Cluster API again before it counts as up).
    #[serde(default)]
    pub karmada_ready: bool,
    /// SHA-256 of the CRD files last installed, to reinstall them only when they change.
    pub crds_digest: Option<String>,
    /// The host's primary address: what pods and kubelets dial (see [`crate::hostnet`]).
    #[serde(default)]
    pub host_address: Option<std::net::Ipv4Addr>,
    /// `net.ipv4.ip_forward` before the first node started, restored by teardown.
    #[serde(default)]
    pub ip_forward_before: Option<String>,
    /// The processes of each cell's node (containerd, kube-controller-manager, kube-scheduler,
    /// kubelet).
    #[serde(default)]
    pub nodes: NodeProcesses,
    /// The images imported into each cell's containerd.
    #[serde(default)]
    pub imported_images: BTreeMap<Cluster, Vec<String>>,
}

/// One apiserver's entry in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ApiserverState {
    /// The cluster it serves.
    pub cluster: Cluster,
    /// Its secure port.
    pub port: u16,
    /// Its etcd prefix.
    pub etcd_prefix: String,
    /// The running process, `None` while stopped.
    pub process: Option<ProcessRecord>,
}

impl State {
    /// A state for an environment that is about to start (nothing running yet).
    pub fn new(ports: Ports, binaries: Binaries, admin_token: String) -> State {
        State {
            format: FORMAT,
            ports,
            binaries,
            admin_token,
            etcd: None,
            apiservers: Cluster::ALL
                .into_iter()
                .map(|cluster| ApiserverState {
                    cluster,
                    port: ports.apiserver(cluster),
                    etcd_prefix: cluster.etcd_prefix().to_owned(),
                    process: None,
                })
                .collect(),
            daemons: BTreeMap::new(),
            karmada_ready: false,
            crds_digest: None,
            host_address: None,
            ip_forward_before: None,
            nodes: BTreeMap::new(),
            imported_images: BTreeMap::new(),
        }
    }

    /// The state file of a state directory.
    pub fn path(dir: &Path) -> PathBuf {
        dir.join("state.json")
    }

    /// Reads the state file; `Ok(None)` if there is none or it has another format (an older
    /// harness's; its processes are then found as leftovers by their command lines).
    pub fn load(dir: &Path) -> Result<Option<State>> {
        let path = State::path(dir);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(io_context(format!("reading {}", path.display()))(error)),
        };
        // The format first: a file an older harness wrote may lack fields this one needs.
        #[derive(Deserialize)]
        struct Format {
            format: u32,
        }
        let format: Format = serde_json::from_str(&text).map_err(|source| Error::State {
            path: path.clone(),
            source,
        })?;
        if format.format != FORMAT {
            tracing::info!(path = %path.display(), format = format.format, "ignoring a state file of another format");
            return Ok(None);
        }
        let state: State = serde_json::from_str(&text).map_err(|source| Error::State { path, source })?;
        Ok(Some(state))
    }

    /// Writes the state file atomically (write to a temporary file, then rename).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = State::path(dir);
        let text = serde_json::to_string_pretty(self).map_err(|source| Error::State {
            path: path.clone(),
            source,
        })?;
        let temporary = dir.join("state.json.tmp");
        std::fs::write(&temporary, text + "\n").map_err(io_context(format!("writing {}", temporary.display())))?;
        std::fs::rename(&temporary, &path)
            .map_err(io_context(format!("renaming {} to state.json", temporary.display())))
    }

    /// Deletes the state file (if any).
    pub fn remove(dir: &Path) -> Result<()> {
        let path = State::path(dir);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(io_context(format!("removing {}", path.display()))(error)),
        }
    }

    /// The state of a cluster's apiserver.
    pub fn apiserver(&self, cluster: Cluster) -> Option<&ApiserverState> {
        self.apiservers.iter().find(|entry| entry.cluster == cluster)
    }

    /// Records the process serving a cluster (`None` once stopped).
    pub fn set_apiserver_process(&mut self, cluster: Cluster, process: Option<ProcessRecord>) {
        if let Some(entry) = self.apiservers.iter_mut().find(|e| e.cluster == cluster) {
            entry.process = process;
        }
    }

    /// The names of the processes the state file in `dir` records that are still running (same
    /// pid and start time); empty when there is no readable state file or none of them runs.
    pub fn running_in(dir: &Path) -> Vec<String> {
        State::load(dir)
            .ok()
            .flatten()
            .map(|state| {
                state
                    .processes()
                    .into_iter()
                    .filter(|(_, process)| process.is_alive())
                    .map(|(name, _)| name)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every recorded process with a human-readable name, in shutdown order (the cells' nodes,
    /// kubelet first and containerd last; the daemons in reverse start order; apiservers;
    /// etcd).
    pub fn processes(&self) -> Vec<(String, ProcessRecord)> {
        let mut all = Vec::new();
        for (cell, components) in &self.nodes {
            for component in NodeComponent::ALL.into_iter().rev() {
                if let Some(process) = components.get(&component) {
                    all.push((format!("{} {cell}", component.name()), process.clone()));
                }
            }
        }
        for daemon in Daemon::ALL.into_iter().rev() {
            if let Some(process) = self.daemons.get(&daemon) {
                all.push((daemon.name().to_owned(), process.clone()));
            }
        }
        for entry in &self.apiservers {
            if let Some(process) = &entry.process {
                all.push((format!("kube-apiserver {}", entry.cluster), process.clone()));
            }
        }
        if let Some(etcd) = &self.etcd {
            all.push(("etcd".to_owned(), etcd.clone()));
        }
        all
    }
}

/// A process of a cell's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeComponent {
    /// The cell's own containerd.
    Containerd,
    /// The cell's kube-controller-manager.
    KubeControllerManager,
    /// The cell's kube-scheduler.
    KubeScheduler,
    /// The cell's kubelet.
    Kubelet,
}

impl NodeComponent {
    /// Every component, in start order.
    pub const ALL: [NodeComponent; 4] = [
        NodeComponent::Containerd,
        NodeComponent::KubeControllerManager,
        NodeComponent::KubeScheduler,
        NodeComponent::Kubelet,
    ];

    /// The executable's name (`containerd`, `kube-controller-manager`, ...).
    pub fn name(self) -> &'static str {
        match self {
            NodeComponent::Containerd => "containerd",
            NodeComponent::KubeControllerManager => "kube-controller-manager",
            NodeComponent::KubeScheduler => "kube-scheduler",
            NodeComponent::Kubelet => "kubelet",
        }
    }
}

/// The processes of every cell's node, by cell, as recorded in `state.json`.
pub(crate) type NodeProcesses = BTreeMap<Cluster, BTreeMap<NodeComponent, ProcessRecord>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_file_of_another_format_is_ignored() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("replicator-e2e-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(State::path(&dir), r#"{"format": 1, "ports": {"hub": 1}}"#)?;
        assert!(State::load(&dir)?.is_none());
        let state = State::new(Ports::default(), Binaries::expected(), "token".to_owned());
        state.save(&dir)?;
        assert_eq!(State::load(&dir)?, Some(state));
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[tokio::test]
    async fn a_state_file_whose_processes_are_gone_records_nothing_running() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("replicator-e2e-running-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        assert!(State::running_in(&dir).is_empty(), "no state file");
        let sleep = crate::process::spawn_detached(Path::new("/bin/sleep"), &["600".into()], &dir.join("sleep.log"))?;
        let mut state = State::new(Ports::default(), Binaries::expected(), "token".to_owned());
        state.etcd = Some(sleep.clone());
        state.save(&dir)?;
        assert_eq!(State::running_in(&dir), vec!["etcd".to_owned()]);
        sleep.terminate("sleep", std::time::Duration::from_secs(5)).await?;
        assert!(State::running_in(&dir).is_empty(), "the recorded etcd has exited");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
