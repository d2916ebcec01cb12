//! The environment: one etcd, four kube-apiservers (`hub`, `cell-a`, `cell-b`, `edge-1`, each
//! under its own etcd prefix), and on the hub a real Karmada control plane: kube-controller-manager
//! and the Karmada aggregated apiserver, webhook, controller-manager and scheduler, with the
//! three other clusters registered as push-mode members (see [`crate::karmada`]). All are real
//! binaries running as detached processes on loopback ports.
//!
//! Layout of the state directory (`$REPLICATOR_ENV_DIR`, default `<workspace>/target/replicator-env`):
//!
//! ```text
//! state.json            pids, start times, ports, binaries (see `state.rs`)
//! .lock                 flock held while starting or stopping the environment
//! etcd/                 etcd's data directory
//! pki/                  CA (cert and key), apiserver and karmada-webhook serving certs, front-proxy
//!                       CA and client cert, service-account keys, tokens.csv
//! kubeconfigs/          <cluster>.kubeconfig (admin), hub-controller-manager.kubeconfig,
//!                       hub-karmada.kubeconfig
//! karmada/              the rewritten webhook configuration the harness applied
//! logs/                 <component>.log for every process, replicator-<location>-<n>.log
//! ```

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use futures::future::{join_all, try_join_all};
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::process::Command;

/// The hub namespace of the replicator's Leases (`replicator run --lease-namespace` default).
pub const LEASE_NAMESPACE: &str = "replicator-system";

use crate::binaries::Binaries;
use crate::cluster::Cluster;
use crate::command::{self, combined_output, describe};
use crate::crds;
use crate::daemon::{Daemon, Probe};
use crate::error::{Error, Result, io_context};
use crate::files::{flag, write_private};
use crate::hostnet;
use crate::images::Images;
use crate::kubeconfig;
use crate::node;
use crate::paths;
use crate::pki::{Pki, Tokens};
use crate::ports::Ports;
use crate::process::{self, ProcessRecord, log_tail};
use crate::state::NodeComponent;
use crate::state::State;
use crate::wait::{self, Check};

/// How long etcd may take to answer `/health`.
const ETCD_READY: Duration = Duration::from_secs(60);
/// How long an apiserver may take to answer `/readyz` (three start at once on a small machine).
const APISERVER_READY: Duration = Duration::from_secs(180);
/// How long a restarted hub may take to serve the aggregated Karmada API again.
const AGGREGATED_API_AFTER_RESTART: Duration = Duration::from_secs(120);
/// How long a reused environment's members may take to be Ready again.
const MEMBERS_READY_ON_REUSE: Duration = Duration::from_secs(60);
/// How long a process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// How long a daemon (a stateless client of the hub) gets between SIGTERM and SIGKILL; one that
/// is still starting may ignore SIGTERM until its caches sync.
const DAEMON_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long a port may keep accepting connections after its process is gone.
const PORT_RELEASE: Duration = Duration::from_secs(10);
/// How long `down` waits for init to reap the stopped processes.
const REAP_DEADLINE: Duration = Duration::from_secs(10);
/// The timeout of one health probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How many log lines an error about a component quotes.
const LOG_TAIL_LINES: usize = 40;
/// Executable names of every process the harness starts, for the leftover sweep.
const EXECUTABLES: [&str; 12] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "containerd",
    // A shim's command line names its containerd's socket, inside the state directory.
    "containerd-shim-runc-v2",
    "karmada-aggregated-apiserver",
    "karmada-webhook",
    "karmada-controller-manager",
    "karmada-scheduler",
    "replicator",
];
/// The lock file inside the state directory (survives a fresh start's cleanup).
const LOCK_FILE: &str = ".lock";

/// A running environment.
///
/// Obtain one with [`Environment::ensure_up`]. The processes are detached: they keep running
/// after this value (and the process holding it) is gone, until [`Environment::down`] or
/// `replicator-env down`.
pub struct Environment {
    pub(crate) dir: PathBuf,
    pub(crate) pki: Pki,
    pub(crate) ports: Ports,
    pub(crate) binaries: Binaries,
    pub(crate) admin_token: String,
    http: reqwest::Client,
    pub(crate) state: tokio::sync::Mutex<State>,
    reused: bool,
}

impl std::fmt::Debug for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The admin token stays out of debug output.
        f.debug_struct("Environment")
            .field("dir", &self.dir)
            .field("ports", &self.ports)
            .field("binaries", &self.binaries)
            .field("reused", &self.reused)
            .finish_non_exhaustive()
    }
}

/// The observed health of one component of the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentStatus {
    /// `etcd`, a cluster name (`hub`, `cell-a`, ...) for apiservers, or a daemon's name
    /// (`kube-controller-manager`, `karmada-webhook`, ...).
    pub name: String,
    /// The cluster, for apiservers.
    pub cluster: Option<Cluster>,
    /// The URL probed.
    pub url: String,
    /// The recorded pid, if the component is supposed to run.
    pub pid: Option<u32>,
    /// Whether the recorded process is running.
    pub running: bool,
    /// `Ok(())` if the probe answered 200, otherwise what went wrong.
    pub ready: std::result::Result<(), String>,
}

/// The observed health of a whole environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The state directory.
    pub dir: PathBuf,
    /// etcd, the apiservers, kube-controller-manager, the Karmada components and each cell's
    /// containerd, kube-controller-manager, kube-scheduler and kubelet.
    pub components: Vec<ComponentStatus>,
    /// The Karmada member `Cluster`s as the hub reports them.
    pub members: Vec<MemberStatus>,
    /// Each cell's Node.
    pub nodes: Vec<NodeStatus>,
}

/// A cell's Node as its apiserver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    /// The cell.
    pub cell: Cluster,
    /// The Node's name.
    pub name: String,
    /// `Ok(())` when the Node's Ready condition is True, otherwise what it says.
    pub ready: std::result::Result<(), String>,
}

impl Status {
    /// Whether every component runs and answers its probe, every member is Ready and every
    /// cell's Node is Ready.
    pub fn healthy(&self) -> bool {
        self.processes_healthy()
            && self.members.iter().all(|member| member.ready.is_ok())
            && self.nodes.iter().all(|node| node.ready.is_ok())
    }

    /// Whether every component runs and answers its probe (members not considered).
    pub fn processes_healthy(&self) -> bool {
        self.components
            .iter()
            .all(|component| component.running && component.ready.is_ok())
    }
}

/// The observed state of one Karmada member `Cluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// The member cluster.
    pub cluster: Cluster,
    /// `Ok(())` if the `Cluster` is Ready and carries no not-ready/unreachable taint; otherwise
    /// what was observed.
    pub ready: std::result::Result<(), String>,
}

impl Environment {
    /// Brings the environment in the default state directory ([`paths::state_dir`]) up, reusing
    /// a healthy running one; see [`Environment::ensure_up_at`].
    pub async fn ensure_up() -> Result<Environment> {
        Environment::ensure_up_at(&paths::state_dir()).await
    }

    /// Brings the environment in `dir` up.
    ///
    /// If `dir` holds a running environment whose processes are all alive and ready, it is
    /// reused (CRDs are reinstalled only if `config/crds` changed). Otherwise leftovers are
    /// killed, the directory is wiped, the binaries are built if missing (the build script's
    /// output is streamed), and everything is started fresh: PKI, kubeconfigs, etcd, the three
    /// apiservers, the hub's kube-controller-manager, the CRDs. If a fresh start fails, whatever
    /// it started is stopped again (the logs stay) and the error names the component that
    /// failed, with the tail of its log.
    ///
    /// Concurrent callers on the same directory are serialised by a file lock.
    pub async fn ensure_up_at(dir: &Path) -> Result<Environment> {
        let dir = paths::absolute(dir.to_path_buf());
        std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        let _lock = lock_dir(&dir).await?;
        if let Some(env) = Environment::reusable(&dir).await? {
            tracing::info!(dir = %dir.display(), "environment already up; reusing it");
            env.install_crds_if_changed().await?;
            // A scenario may have removed the hub's replicator-system (the manifest check does);
            // applying config/rbac/hub on every reuse would cost each scenario a kubectl run.
            let namespaces = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(env.client(Cluster::Hub).await?);
            if namespaces.get_opt(LEASE_NAMESPACE).await?.is_none() {
                env.ensure_lease_namespace().await?;
            }
            return Ok(env);
        }
        match Environment::start_fresh(&dir).await {
            Ok(env) => Ok(env),
            Err(error) => {
                // Leave no half-started environment behind; the logs stay for inspection.
                let state = State::load(&dir).ok().flatten();
                if let Err(cleanup) = stop_all(&dir, state.as_ref()).await {
                    tracing::warn!(%cleanup, "stopping the half-started environment failed");
                }
                Err(error)
            }
        }
    }

    /// The environment recorded in `dir`, without checking or starting anything.
    pub async fn attach(dir: &Path) -> Result<Environment> {
        let dir = paths::absolute(dir.to_path_buf());
        let state = State::load(&dir)?.ok_or_else(|| Error::NotUp(dir.clone()))?;
        Environment::from_state(&dir, state, true).await
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether [`Environment::ensure_up`] found this environment already running.
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// The environment's PKI (its CA can sign more certificates, for example for webhooks).
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// The environment's ports.
    pub fn ports(&self) -> Ports {
        self.ports
    }

    /// The control-plane binaries the environment runs.
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// The admin bearer token (`system:masters`).
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The directory of the environment's log files.
    pub fn logs_dir(&self) -> PathBuf {
        logs_dir(&self.dir)
    }

    /// The hub apiserver's audit log: JSON lines, one `audit.k8s.io/v1` Event per write
    /// (metadata level); reads are not logged.
    pub fn hub_audit_log(&self) -> PathBuf {
        audit_log_path(&self.dir)
    }

    /// `https://127.0.0.1:<port>` of a cluster's apiserver.
    pub fn server_url(&self, cluster: Cluster) -> String {
        format!("https://127.0.0.1:{}", self.ports.apiserver(cluster))
    }

    /// `http://127.0.0.1:<port>` of etcd's client endpoint.
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.etcd_client)
    }

    /// The admin kubeconfig of a cluster: `<state>/kubeconfigs/<cluster>.kubeconfig`.
    pub fn kubeconfig_path(&self, cluster: Cluster) -> PathBuf {
        kubeconfig::path(&self.dir, cluster)
    }

    /// A Kubernetes client for a cluster, authenticated as admin.
    pub async fn client(&self, cluster: Cluster) -> Result<kube::Client> {
        kubeconfig::client(&self.kubeconfig_path(cluster)).await
    }

    /// Runs `kubectl --kubeconfig <cluster's kubeconfig> <args>` and returns its output,
    /// whatever its exit status.
    pub async fn kubectl<I, S>(&self, cluster: Cluster, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        command::run(&mut self.kubectl_command(cluster, args)).await
    }

    /// Like [`Environment::kubectl`], but fails unless kubectl succeeds; returns its stdout.
    pub async fn kubectl_ok<I, S>(&self, cluster: Cluster, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = self.kubectl_command(cluster, args);
        let output = command::run(&mut command).await?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(Error::CommandFailed {
                command: describe(&command),
                status: output.status,
                output: combined_output(&output),
            })
        }
    }

    /// The kubectl command line for a cluster, not yet run.
    pub(crate) fn kubectl_command<I, S>(&self, cluster: Cluster, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(&self.binaries.kubectl);
        command
            .arg("--kubeconfig")
            .arg(self.kubeconfig_path(cluster))
            .args(args);
        command
    }

    /// The pid of a cluster's apiserver, `None` while it is stopped.
    pub async fn apiserver_pid(&self, cluster: Cluster) -> Option<u32> {
        let state = self.state.lock().await;
        state
            .apiserver(cluster)
            .and_then(|entry| entry.process.as_ref())
            .map(|process| process.pid)
    }

    /// Stops a cluster's apiserver (for outage tests): SIGTERM, wait until the process is gone
    /// and its port refuses connections, SIGKILL after a deadline. Stopping a stopped apiserver
    /// does nothing.
    pub async fn stop_apiserver(&self, cluster: Cluster) -> Result<()> {
        let mut state = self.state.lock().await;
        let port = self.ports.apiserver(cluster);
        let process = state.apiserver(cluster).and_then(|entry| entry.process.clone());
        if let Some(process) = process {
            let name = format!("kube-apiserver {cluster}");
            tracing::info!(%cluster, pid = process.pid, "stopping apiserver");
            process.signal(nix::sys::signal::Signal::SIGTERM)?;
            let what = format!("{name} (pid {}) to exit and release port {port}", process.pid);
            let stopped = wait::until_observed(STOP_GRACE, &what, || {
                let alive = process.is_alive();
                async move {
                    Ok::<_, Error>(if alive {
                        Check::NotYet("the process is still running".to_owned())
                    } else if !port_refuses(port).await {
                        Check::NotYet(format!("port {port} still accepts connections"))
                    } else {
                        Check::Ready(())
                    })
                }
            })
            .await;
            if let Err(error) = stopped {
                tracing::warn!(%error, "apiserver did not stop after SIGTERM; sending SIGKILL");
                process.kill_and_wait(&name).await?;
            }
            state.set_apiserver_process(cluster, None);
            state.save(&self.dir)?;
        }
        drop(state);
        wait_port_refuses(port, &format!("port {port} of {cluster} to refuse connections")).await
    }

    /// Starts a cluster's apiserver with the same flags and port as before and waits until it
    /// answers `/readyz`. If it is already running, only waits for readiness.
    ///
    /// A restarted hub comes back as a whole: the call also waits until the aggregated Karmada
    /// API (`Cluster`s) is served again, and restarts the processes that watch the hub
    /// (kube-controller-manager, karmada-webhook, -controller-manager, -scheduler; they kept
    /// running through the outage). Left alone, their informers would sit out client-go's
    /// reconnect backoff (up to 30 s) and then relist after "too old resource version" (the
    /// shared etcd's revision moved on): 40–60 s in which the hub's namespace controller and
    /// Karmada act on nothing.
    pub async fn start_apiserver(&self, cluster: Cluster) -> Result<()> {
        let started = self.start_apiserver_process(cluster).await?;
        let karmada_ready = self.state.lock().await.karmada_ready;
        if cluster == Cluster::Hub && karmada_ready {
            self.wait_aggregated_api(AGGREGATED_API_AFTER_RESTART).await?;
            if started {
                self.restart_hub_watchers().await?;
            }
        }
        Ok(())
    }

    /// Starts a cluster's apiserver unless it runs, then waits for `/readyz`; returns whether
    /// it started a process.
    async fn start_apiserver_process(&self, cluster: Cluster) -> Result<bool> {
        let mut state = self.state.lock().await;
        let running = state
            .apiserver(cluster)
            .and_then(|entry| entry.process.clone())
            .filter(ProcessRecord::is_alive);
        let started = running.is_none();
        let process = match running {
            Some(process) => process,
            None => {
                if cluster == Cluster::Hub {
                    // Written at every start: an environment started before the hub was audited
                    // gets its policy on the first restart of the hub.
                    std::fs::write(audit_policy_path(&self.dir), AUDIT_POLICY).map_err(io_context(format!(
                        "writing {}",
                        audit_policy_path(&self.dir).display()
                    )))?;
                }
                let port = self.ports.apiserver(cluster);
                if !port_refuses(port).await {
                    return Err(Error::PortInUse {
                        port,
                        component: format!("kube-apiserver {cluster}"),
                    });
                }
                tracing::info!(%cluster, port, "starting apiserver");
                let log = logs_dir(&self.dir).join(format!("kube-apiserver-{cluster}.log"));
                let process =
                    process::spawn_detached(&self.binaries.kube_apiserver, &self.apiserver_args(cluster), &log)?;
                state.set_apiserver_process(cluster, Some(process.clone()));
                state.save(&self.dir)?;
                process
            }
        };
        drop(state);
        self.wait_ready(
            &format!("kube-apiserver {cluster}"),
            &process,
            &format!("{}/readyz", self.server_url(cluster)),
            Probe::Ok200WithToken,
            APISERVER_READY,
        )
        .await?;
        Ok(started)
    }

    /// Installs every `config/crds/*.yaml` into every cluster (server-side apply) and waits until
    /// each CRD is Established.
    pub async fn install_crds(&self) -> Result<()> {
        let files = crds::files(&paths::crds_dir())?;
        let digest = crds::digest(&files)?;
        if !files.is_empty() {
            tracing::info!(files = files.len(), "installing CRDs into every cluster");
            try_join_all(
                Cluster::ALL
                    .into_iter()
                    .map(|cluster| self.install_crd_files(cluster, &files)),
            )
            .await?;
        }
        let mut state = self.state.lock().await;
        state.crds_digest = Some(digest);
        state.save(&self.dir)
    }

    /// Installs CRD `files` into `cluster` ([`crds::install`]) and waits until each is Established.
    pub(crate) async fn install_crd_files(&self, cluster: Cluster, files: &[PathBuf]) -> Result<Vec<String>> {
        let apply = self.kubectl_command(cluster, crds::apply_args(files));
        crds::install(apply, self.client(cluster).await?, cluster).await
    }

    /// Applies `config/rbac/hub` to the hub, as the README's deploy steps do: namespace
    /// [`LEASE_NAMESPACE`] (with the label that keeps Karmada from propagating it), the hub
    /// service accounts, their ClusterRoles and the Lease Role. Idempotent (server-side apply).
    pub async fn ensure_lease_namespace(&self) -> Result<()> {
        let dir = paths::workspace_root().join("config").join("rbac").join("hub");
        let mut args: Vec<OsString> = vec![
            "apply".into(),
            "--server-side".into(),
            "--force-conflicts".into(),
            "-k".into(),
        ];
        args.push(dir.into_os_string());
        self.kubectl_ok(Cluster::Hub, args).await?;
        Ok(())
    }

    /// Probes every component.
    pub async fn status(&self) -> Status {
        let state = self.state.lock().await.clone();
        let etcd = self.component_status(
            "etcd".to_owned(),
            None,
            state.etcd.as_ref(),
            format!("{}/health", self.etcd_url()),
            Probe::Ok200,
        );
        let apiservers = join_all(Cluster::ALL.into_iter().map(|cluster| {
            let process = state.apiserver(cluster).and_then(|entry| entry.process.as_ref());
            self.component_status(
                cluster.name().to_owned(),
                Some(cluster),
                process,
                format!("{}/readyz", self.server_url(cluster)),
                Probe::Ok200WithToken,
            )
        }));
        let daemons = join_all(Daemon::ALL.map(|daemon| self.daemon_status(daemon, state.daemons.get(&daemon))));
        let members = async {
            if state.karmada_ready {
                self.member_statuses().await
            } else {
                Cluster::MEMBERS
                    .into_iter()
                    .map(|cluster| MemberStatus {
                        cluster,
                        ready: Err("not registered".to_owned()),
                    })
                    .collect()
            }
        };
        let node_components = join_all(Cluster::CELLS.into_iter().flat_map(|cell| {
            let recorded = state.nodes.get(&cell).cloned().unwrap_or_default();
            NodeComponent::ALL.into_iter().map(move |component| {
                let process = recorded.get(&component).cloned();
                async move {
                    let (url, probe) = self.node_component_probe(cell, component);
                    self.component_status(
                        format!("{} {cell}", component.name()),
                        Some(cell),
                        process.as_ref(),
                        url,
                        probe,
                    )
                    .await
                }
            })
        }));
        let nodes = join_all(Cluster::CELLS.into_iter().map(|cell| async move {
            NodeStatus {
                cell,
                name: self.node(cell).node_name().to_owned(),
                ready: self.node_ready(cell).await,
            }
        }));
        let (etcd, apiservers, daemons, members, node_components, nodes) =
            futures::join!(etcd, apiservers, daemons, members, node_components, nodes);
        let mut components = vec![etcd];
        components.extend(apiservers);
        components.extend(daemons);
        components.extend(node_components);
        Status {
            dir: self.dir.clone(),
            components,
            members,
            nodes,
        }
    }

    /// Stops every process of the environment (SIGTERM, SIGKILL after a deadline), kills any
    /// leftover process started from this state directory (including replicators), and removes
    /// `state.json`. Logs, PKI and etcd data stay until the next fresh start.
    pub async fn down(&self) -> Result<()> {
        let _lock = lock_dir(&self.dir).await?;
        let state = self.state.lock().await.clone();
        stop_all(&self.dir, Some(&state)).await
    }

    async fn reusable(dir: &Path) -> Result<Option<Environment>> {
        let state = match State::load(dir) {
            Ok(Some(state)) => state,
            Ok(None) => return Ok(None),
            Err(error) => {
                tracing::warn!(%error, "ignoring an unreadable state file");
                return Ok(None);
            }
        };
        if !state.binaries.missing().is_empty() || state.binaries != Binaries::expected() {
            tracing::info!("the recorded environment runs other binaries; starting fresh");
            return Ok(None);
        }
        if !state.karmada_ready {
            tracing::info!("the recorded environment never completed its start; starting fresh");
            return Ok(None);
        }
        let env = match Environment::from_state(dir, state, true).await {
            Ok(env) => env,
            Err(error) => {
                tracing::info!(%error, "the recorded environment is incomplete; starting fresh");
                return Ok(None);
            }
        };
        let status = env.status().await;
        if status.processes_healthy() {
            // A member may be NotReady for a moment (a member apiserver just restarted).
            return match env.wait_members_ready(MEMBERS_READY_ON_REUSE).await {
                Ok(()) => Ok(Some(env)),
                Err(error) => {
                    tracing::info!(%error, "Karmada members not Ready; starting fresh");
                    Ok(None)
                }
            };
        }
        for component in status.components {
            if let Err(problem) = component.ready {
                tracing::info!(component = component.name, problem, "not healthy; starting fresh");
            }
        }
        Ok(None)
    }

    async fn from_state(dir: &Path, state: State, reused: bool) -> Result<Environment> {
        let pki = Pki::new(dir.join("pki"));
        let ca = pki.ca_pem().await?;
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(reqwest::Certificate::from_pem(&ca)?)
            .no_proxy()
            .timeout(PROBE_TIMEOUT)
            .build()?;
        Ok(Environment {
            dir: dir.to_path_buf(),
            pki,
            ports: state.ports,
            binaries: state.binaries.clone(),
            admin_token: state.admin_token.clone(),
            http,
            state: tokio::sync::Mutex::new(state),
            reused,
        })
    }

    async fn start_fresh(dir: &Path) -> Result<Environment> {
        if node::kubelets_possible().is_ok() {
            // Before anything is stopped or cleaned: another environment's nodes stay untouched.
            node::check_nodes_free(dir)?;
        }
        stop_all(dir, State::load(dir).ok().flatten().as_ref()).await?;
        let binaries = Binaries::ensure().await?;
        let ports = Ports::from_env()?;
        for (component, port) in ports.all() {
            if !port_refuses(port).await {
                return Err(Error::PortInUse {
                    port,
                    component: component.to_owned(),
                });
            }
        }
        wipe_except_lock(dir)?;
        tracing::info!(dir = %dir.display(), "starting a fresh environment");
        let host = hostnet::primary_address().await?;
        tracing::info!(%host, "the host's primary address: pods and kubelets dial the apiservers here (a pod cannot reach loopback)");
        let pki = Pki::new(dir.join("pki"));
        let tokens = pki.create(host).await?;
        let mut state = State::new(ports, binaries, tokens.admin.clone());
        state.host_address = Some(host);
        state.ip_forward_before = Some(hostnet::ip_forward()?);
        state.save(dir)?;
        let env = Environment::from_state(dir, state, false).await?;
        env.write_kubeconfigs(&tokens).await?;
        let control_plane = async {
            env.start_etcd().await?;
            try_join_all(
                Cluster::ALL
                    .into_iter()
                    .map(|cluster| env.start_apiserver_process(cluster)),
            )
            .await?;
            env.install_crds().await?;
            env.ensure_lease_namespace().await
        };
        // The image build (a release build of the product when it changed) runs beside the
        // control plane's start.
        let kubelets = node::kubelets_possible();
        let images = async {
            if let Err(why) = &kubelets {
                tracing::warn!(
                    why,
                    "the cells run without kubelets (bare apiservers): no pods, the product runs as processes"
                );
                return Ok(None);
            }
            node::ensure_host_packages().await?;
            node::record_nodes_owner(dir)?;
            Images::ensure().await.map(Some)
        };
        let (images, ()) = futures::try_join!(images, control_plane)?;
        let nodes = async {
            match &images {
                Some(images) => try_join_all(Cluster::CELLS.into_iter().map(|cell| env.start_node(cell, images)))
                    .await
                    .map(drop),
                None => Ok(()),
            }
        };
        futures::try_join!(env.start_karmada(), nodes)?;
        {
            let mut state = env.state.lock().await;
            state.karmada_ready = true;
            state.save(dir)?;
        }
        tracing::info!(dir = %dir.display(), "environment up");
        Ok(env)
    }

    async fn install_crds_if_changed(&self) -> Result<()> {
        let digest = crds::digest(&crds::files(&paths::crds_dir())?)?;
        let installed = self.state.lock().await.crds_digest.clone();
        if installed.as_deref() == Some(digest.as_str()) {
            return Ok(());
        }
        self.install_crds().await
    }

    async fn write_kubeconfigs(&self, tokens: &Tokens) -> Result<()> {
        let ca = self.pki.ca_pem().await?;
        let dir = kubeconfig::dir(&self.dir);
        std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        for cluster in Cluster::ALL {
            let text = kubeconfig::render(cluster, &self.server_url(cluster), &ca, "admin", &tokens.admin);
            write_private(&self.kubeconfig_path(cluster), &text)?;
        }
        let text = kubeconfig::render(
            Cluster::Hub,
            &self.server_url(Cluster::Hub),
            &ca,
            "controller-manager",
            &tokens.controller_manager,
        );
        write_private(&kubeconfig::controller_manager_path(&self.dir), &text)?;
        for cell in Cluster::CELLS {
            let text = kubeconfig::render(
                cell,
                &self.server_url(cell),
                &ca,
                "controller-manager",
                &tokens.controller_manager,
            );
            write_private(&kubeconfig::cell_controller_manager_path(&self.dir, cell), &text)?;
        }
        let text = kubeconfig::render(
            Cluster::Hub,
            &self.server_url(Cluster::Hub),
            &ca,
            "karmada",
            &tokens.karmada,
        );
        write_private(&kubeconfig::karmada_path(&self.dir), &text)
    }

    async fn start_etcd(&self) -> Result<()> {
        let client = format!("http://127.0.0.1:{}", self.ports.etcd_client);
        let peer = format!("http://127.0.0.1:{}", self.ports.etcd_peer);
        let args = vec![
            flag("--name", "replicator-e2e"),
            flag("--data-dir", self.dir.join("etcd")),
            flag("--listen-client-urls", &client),
            flag("--advertise-client-urls", &client),
            flag("--listen-peer-urls", &peer),
            flag("--initial-advertise-peer-urls", &peer),
            flag("--initial-cluster", format!("replicator-e2e={peer}")),
            flag("--initial-cluster-state", "new"),
            OsString::from("--unsafe-no-fsync"),
        ];
        tracing::info!(port = self.ports.etcd_client, "starting etcd");
        let log = logs_dir(&self.dir).join("etcd.log");
        let process = process::spawn_detached(&self.binaries.etcd, &args, &log)?;
        {
            let mut state = self.state.lock().await;
            state.etcd = Some(process.clone());
            state.save(&self.dir)?;
        }
        self.wait_ready(
            "etcd",
            &process,
            &format!("{}/health", self.etcd_url()),
            Probe::Ok200,
            ETCD_READY,
        )
        .await
    }

    fn apiserver_args(&self, cluster: Cluster) -> Vec<OsString> {
        let serving = self.pki.apiserver_cert();
        let mut args = vec![
            flag("--etcd-servers", format!("http://127.0.0.1:{}", self.ports.etcd_client)),
            flag("--etcd-prefix", cluster.etcd_prefix()),
            flag("--secure-port", self.ports.apiserver(cluster).to_string()),
            // Every address: the cells' pods reach their own apiserver (through the DNAT rule)
            // and the hub at the host's primary address, never at loopback.
            flag("--bind-address", "0.0.0.0"),
            flag("--advertise-address", "127.0.0.1"),
            flag("--endpoint-reconciler-type", "none"),
            flag("--cert-dir", self.pki.dir().join(cluster.name())),
            flag("--tls-cert-file", &serving.cert),
            flag("--tls-private-key-file", &serving.key),
            flag("--client-ca-file", self.pki.ca_cert()),
            flag("--service-account-issuer", "https://kubernetes.default.svc"),
            flag("--service-account-key-file", self.pki.service_account_public_key()),
            flag("--service-account-signing-key-file", self.pki.service_account_key()),
            flag("--service-cluster-ip-range", cluster.service_cidr()),
            flag("--token-auth-file", self.pki.tokens_file()),
            // Without it, open watches (kube-controller-manager's, the replicator's) hold a
            // SIGTERMed apiserver up to its 60s request timeout; with it, they end at once.
            flag("--shutdown-watch-termination-grace-period", "5s"),
        ];
        if cluster.is_cell() {
            // A real one-node cluster: the kubelet authenticates as system:node:<cell> (Node
            // authorizer), pods get service-account tokens (ServiceAccount admission), and the
            // apiserver reaches the kubelet for logs and exec with a system:masters certificate.
            let kubelet_client = self.pki.kubelet_client_cert();
            args.extend([
                flag("--authorization-mode", "Node,RBAC"),
                flag("--kubelet-client-certificate", &kubelet_client.cert),
                flag("--kubelet-client-key", &kubelet_client.key),
                flag("--kubelet-preferred-address-types", "InternalIP"),
            ]);
        } else {
            // No pods run here: no ServiceAccount admission (nothing makes `default` accounts).
            args.extend([
                flag("--authorization-mode", "RBAC"),
                flag("--disable-admission-plugins", "ServiceAccount"),
            ]);
        }
        if cluster == Cluster::Hub {
            // The hub is the Karmada apiserver: it proxies cluster.karmada.io to the aggregated
            // apiserver, authenticating with the front-proxy client certificate and passing the
            // user in request headers (without these, proxied requests arrive anonymous).
            let proxy_client = self.pki.front_proxy_client_cert();
            args.extend([
                // A SIGTERMed apiserver waits up to the request timeout (default 60s) for open
                // connections; the watches the Karmada components hold through the aggregator
                // are not ended by the watch grace period below, so keep that wait short.
                flag("--request-timeout", "20s"),
                flag("--proxy-client-cert-file", &proxy_client.cert),
                flag("--proxy-client-key-file", &proxy_client.key),
                flag("--requestheader-client-ca-file", self.pki.front_proxy_ca_cert()),
                flag("--requestheader-allowed-names", crate::pki::FRONT_PROXY_CLIENT),
                flag("--requestheader-username-headers", "X-Remote-User"),
                flag("--requestheader-group-headers", "X-Remote-Group"),
                flag("--requestheader-extra-headers-prefix", "X-Remote-Extra-"),
                // Who wrote what on the hub (metadata only, writes only): the security checks
                // count each replicator identity's writes from it (crate::audit).
                flag("--audit-policy-file", audit_policy_path(&self.dir)),
                flag("--audit-log-path", audit_log_path(&self.dir)),
                flag("--audit-log-format", "json"),
                flag("--audit-log-maxsize", "200"),
                flag("--audit-log-maxbackup", "5"),
            ]);
        } else {
            // One compactor for the shared etcd is enough.
            args.push(flag("--etcd-compaction-interval", "0"));
        }
        args
    }

    /// Starts a daemon and waits until it is healthy (see [`Daemon::health_url`]); on failure
    /// the error quotes its log.
    pub(crate) async fn start_daemon(&self, daemon: Daemon, deadline: Duration) -> Result<()> {
        let binary = match daemon {
            Daemon::KubeControllerManager => &self.binaries.kube_controller_manager,
            Daemon::KarmadaAggregatedApiserver => &self.binaries.karmada_aggregated_apiserver,
            Daemon::KarmadaWebhook => &self.binaries.karmada_webhook,
            Daemon::KarmadaControllerManager => &self.binaries.karmada_controller_manager,
            Daemon::KarmadaScheduler => &self.binaries.karmada_scheduler,
        };
        tracing::info!(%daemon, "starting");
        let log = logs_dir(&self.dir).join(format!("{}.log", daemon.name()));
        let process = process::spawn_detached(binary, &self.daemon_args(daemon), &log)?;
        {
            let mut state = self.state.lock().await;
            state.daemons.insert(daemon, process.clone());
            state.save(&self.dir)?;
        }
        self.wait_ready(
            daemon.name(),
            &process,
            &daemon.health_url(&self.ports),
            daemon.probe(),
            deadline,
        )
        .await?;
        Ok(())
    }

    /// Stops a daemon (SIGTERM, SIGKILL after a grace period) if it runs, and forgets it.
    pub(crate) async fn stop_daemon(&self, daemon: Daemon) -> Result<()> {
        let process = self.state.lock().await.daemons.get(&daemon).cloned();
        if let Some(process) = process {
            tracing::info!(%daemon, pid = process.pid, "stopping");
            process.terminate(daemon.name(), DAEMON_STOP_GRACE).await?;
            let mut state = self.state.lock().await;
            state.daemons.remove(&daemon);
            state.save(&self.dir)?;
        }
        Ok(())
    }

    /// [`Error::NotReady`] for a daemon, with the tail of its log.
    pub(crate) fn daemon_error(&self, daemon: Daemon, reason: Error) -> Error {
        let log = logs_dir(&self.dir).join(format!("{}.log", daemon.name()));
        Error::NotReady {
            component: daemon.name().to_owned(),
            reason: Box::new(reason),
            log_tail: log_tail(&log, LOG_TAIL_LINES),
            log,
        }
    }

    async fn daemon_status(&self, daemon: Daemon, process: Option<&ProcessRecord>) -> ComponentStatus {
        self.component_status(
            daemon.name().to_owned(),
            None,
            process,
            daemon.health_url(&self.ports),
            daemon.probe(),
        )
        .await
    }

    /// Polls `url` until it answers 200, failing early if the process exits; on failure the
    /// error carries the tail of the component's log.
    pub(crate) async fn wait_ready(
        &self,
        component: &str,
        process: &ProcessRecord,
        url: &str,
        probe: Probe,
        deadline: Duration,
    ) -> Result<()> {
        let what = format!("{component} to answer {url}");
        let result = wait::until_observed(deadline, &what, move || {
            let alive = process.is_alive();
            async move {
                if !alive {
                    return Ok::<_, Error>(Check::Abort(format!("the process (pid {}) exited", process.pid)));
                }
                Ok(match self.probe(url, probe).await {
                    Ok(()) => Check::Ready(()),
                    Err(problem) => Check::NotYet(problem),
                })
            }
        })
        .await;
        result.map_err(|reason| Error::NotReady {
            component: component.to_owned(),
            reason: Box::new(reason),
            log: process.log.clone(),
            log_tail: log_tail(&process.log, LOG_TAIL_LINES),
        })
    }

    /// GETs `url`; `Ok` on 200 (or on any answer for [`Probe::AnyAnswer`]), otherwise a
    /// description of the answer or the failure.
    pub(crate) async fn probe(&self, url: &str, probe: Probe) -> std::result::Result<(), String> {
        if probe == Probe::ContainerdSocket {
            return node::containerd_answers(Path::new(url.trim_start_matches("unix://"))).await;
        }
        let mut request = self.http.get(url);
        if probe == Probe::Ok200WithToken {
            request = request.bearer_auth(&self.admin_token);
        }
        let response = request.send().await.map_err(|error| error_chain(&error))?;
        let status = response.status();
        if status == reqwest::StatusCode::OK || probe == Probe::AnyAnswer {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        let failed: Vec<&str> = body.lines().filter(|line| line.starts_with("[-]")).collect();
        let detail = if failed.is_empty() {
            body.trim().chars().take(300).collect::<String>()
        } else {
            failed.join("; ")
        };
        Err(format!("HTTP {status}: {detail}"))
    }

    async fn component_status(
        &self,
        name: String,
        cluster: Option<Cluster>,
        process: Option<&ProcessRecord>,
        url: String,
        probe: Probe,
    ) -> ComponentStatus {
        let running = process.is_some_and(ProcessRecord::is_alive);
        let ready = match process {
            None => Err("stopped".to_owned()),
            Some(process) if !running => Err(format!("process {} is not running", process.pid)),
            Some(_) => self.probe(&url, probe).await,
        };
        ComponentStatus {
            name,
            cluster,
            url,
            pid: process.map(|process| process.pid),
            running,
            ready,
        }
    }
}

/// Probes the environment recorded in `dir` without changing anything.
pub async fn status(dir: &Path) -> Result<Status> {
    Ok(Environment::attach(dir).await?.status().await)
}

/// Stops whatever environment `dir` holds, even one whose state file is missing or unreadable
/// (leftover processes are found through their command lines), and removes `state.json`.
pub async fn teardown(dir: &Path) -> Result<()> {
    let dir = paths::absolute(dir.to_path_buf());
    if !dir.is_dir() {
        return Ok(());
    }
    let _lock = lock_dir(&dir).await?;
    let state = State::load(&dir).ok().flatten();
    stop_all(&dir, state.as_ref()).await
}

/// What an environment at `dir` left on the host after `down`, one line each: processes started
/// from it (and processes still in the cells' cgroups), mounts under it, the cells' cgroups,
/// bridges, the harness's iptables rules and the kubelets' chains. Empty when clean.
pub async fn leftovers(dir: &Path) -> Result<Vec<String>> {
    let dir = paths::absolute(dir.to_path_buf());
    let mut found: Vec<String> = process::find(&dir, &EXECUTABLES)?
        .into_iter()
        .map(|(record, exe)| format!("process {} ({exe})", record.pid))
        .collect();
    found.extend(
        hostnet::mounts_under(&dir)?
            .into_iter()
            .map(|point| format!("mount {}", point.display())),
    );
    for cell in Cluster::CELLS {
        let layout = node::NodeLayout::new(&dir, cell);
        for pid in hostnet::cgroup_processes(&layout.cgroup_root())? {
            found.push(format!("process {pid} in cgroup {}", layout.cgroup_root()));
        }
        for hierarchy in hostnet::cgroup_hierarchies()? {
            let cgroup = hierarchy.join(layout.cgroup_root());
            if cgroup.exists() {
                found.push(format!("cgroup {}", cgroup.display()));
            }
        }
        if Path::new("/sys/class/net").join(layout.bridge()).exists() {
            found.push(format!("network interface {}", layout.bridge()));
        }
    }
    found.extend(hostnet::rules_and_kubelet_chains().await?);
    Ok(found)
}

/// The admin kubeconfig of `cluster` in the environment at `dir`.
pub fn kubeconfig_path(dir: &Path, cluster: Cluster) -> PathBuf {
    kubeconfig::path(dir, cluster)
}

/// Stops the recorded processes (the daemons, then the apiservers, then etcd), sweeps
/// leftovers, removes the state file.
async fn stop_all(dir: &Path, state: Option<&State>) -> Result<()> {
    let mut stopped = Vec::new();
    if let Some(state) = state.filter(|state| !state.nodes.is_empty()) {
        // Pods first, while the apiservers and kubelets run: no controller recreates them, and
        // each kubelet tears its sandboxes down (network namespaces, veths) the normal way.
        for (cell, components) in &state.nodes {
            for component in [NodeComponent::KubeControllerManager, NodeComponent::KubeScheduler] {
                if let Some(process) = components.get(&component) {
                    process
                        .terminate(&format!("{} {cell}", component.name()), DAEMON_STOP_GRACE)
                        .await?;
                }
            }
        }
        match Environment::from_state(dir, state.clone(), true).await {
            Ok(env) => env.drain_nodes().await,
            Err(error) => tracing::warn!(%error, "cannot reach the cells to delete their pods; killing them instead"),
        }
    }
    if let Some(state) = state {
        let processes = state.processes();
        let group_of = |name: &str| {
            if name == "etcd" {
                2
            } else if name.starts_with("kube-apiserver") {
                1
            } else {
                0
            }
        };
        for group in 0..=2 {
            let grace = if group == 0 { DAEMON_STOP_GRACE } else { STOP_GRACE };
            try_join_all(
                processes
                    .iter()
                    .filter(|(name, _)| group_of(name) == group)
                    .map(|(name, process)| process.terminate(name, grace)),
            )
            .await?;
        }
        stopped.extend(processes.into_iter().map(|(_, process)| process));
    }
    let leftovers = process::sweep(dir, &EXECUTABLES).await?;
    if !leftovers.is_empty() {
        let pids: Vec<u32> = leftovers.iter().map(|process| process.pid).collect();
        tracing::info!(?pids, "killed leftover processes");
    }
    stopped.extend(leftovers);
    process::wait_reaped(&stopped, REAP_DEADLINE).await;
    node::clean_host(dir, state.and_then(|state| state.ip_forward_before.as_deref())).await?;
    State::remove(dir)
}

/// Takes the state directory's exclusive lock, waiting for another holder if necessary.
pub(crate) async fn lock_dir(dir: &Path) -> Result<Flock<File>> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_context(format!("opening {}", path.display())))?;
    let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => return Ok(lock),
        Err((file, Errno::EWOULDBLOCK)) => file,
        Err((_, source)) => return Err(Error::Lock { path, source }),
    };
    tracing::info!(lock = %path.display(), "another harness holds the environment lock; waiting");
    let lock_path = path.clone();
    tokio::task::spawn_blocking(move || {
        Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, source)| Error::Lock {
            path: lock_path,
            source,
        })
    })
    .await
    .map_err(|join| io_context(format!("waiting for {}", path.display()))(std::io::Error::other(join)))?
}

/// Empties the state directory except for its lock file.
fn wipe_except_lock(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(io_context(format!("listing {}", dir.display())))?;
    for entry in entries {
        let entry = entry.map_err(io_context(format!("listing {}", dir.display())))?;
        if entry.file_name() == LOCK_FILE {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(io_context(format!("removing {}", path.display())))?;
    }
    Ok(())
}

fn logs_dir(dir: &Path) -> PathBuf {
    dir.join("logs")
}

/// The hub apiserver's audit policy: reads are not logged; the writes of every service account at
/// `RequestResponse` level, so the object written (its labels, the subject of an Event) can be
/// checked ([`crate::audit::foreign_writes`]) whichever namespace holds the identity (the shipped
/// `replicator-system`, the harness's `replicator-e2e`, the identities a scenario composes or
/// deploys in a namespace of its own); every other write at `Metadata` level, who and what
/// without bodies.
const AUDIT_POLICY: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  verbs: [get, list, watch]
- level: RequestResponse
  userGroups: [\"system:serviceaccounts\"]
- level: Metadata
";

fn audit_policy_path(dir: &Path) -> PathBuf {
    dir.join("pki").join("hub-audit-policy.yaml")
}

/// The hub apiserver's audit log (JSON lines, one event per request; see [`crate::audit`]).
pub fn audit_log_path(dir: &Path) -> PathBuf {
    logs_dir(dir).join("hub-audit.log")
}

/// Whether connecting to `127.0.0.1:port` is refused (nothing listens there).
async fn port_refuses(port: u16) -> bool {
    let connect = tokio::net::TcpStream::connect(("127.0.0.1", port));
    match tokio::time::timeout(PROBE_TIMEOUT, connect).await {
        Ok(Ok(_stream)) => false,
        Ok(Err(error)) => error.kind() == std::io::ErrorKind::ConnectionRefused,
        Err(_elapsed) => false,
    }
}

async fn wait_port_refuses(port: u16, what: &str) -> Result<()> {
    wait::until(PORT_RELEASE, what, || async move {
        Ok::<_, Error>(port_refuses(port).await.then_some(()))
    })
    .await
}

/// An error and its sources, joined with ": ".
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
