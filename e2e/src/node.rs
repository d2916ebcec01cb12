//! The cells as real one-node clusters: per cell a containerd of its own (a kubelet removes
//! containers it did not start, so two kubelets never share one), a kubelet, kube-scheduler and
//! kube-controller-manager, CNI (a bridge with host-local IPAM on the cell's pod range), the cell's
//! cgroup root, and the DNAT rule that lets its pods reach their apiserver without kube-proxy.
//!
//! Layout of a node inside the state directory (`<state>/nodes/<cell>/`):
//!
//! ```text
//! containerd.toml        the cell's containerd configuration
//! containerd/            its root, state (netns mounts too), opt, gRPC and ttrpc sockets
//! runc/                  runc's state (`Root`), apart from the other cell's
//! cni/net.d/             the bridge conflist; cni/ipam/ host-local's leases
//! kubelet/               the kubelet's --root-dir (pods, volumes); kubelet-config.yaml
//! pki/                   the kubelet's client certificate (CN=system:node:<cell>)
//! pod-logs/              podLogsDir
//! ```
//!
//! The facts behind every setting come from a trial on this kind of machine; each is logged when
//! it is applied (see [`Environment::start_node`]).

use std::ffi::OsString;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use tokio::process::Command;

use crate::cluster::Cluster;
use crate::command::{run, run_checked};
use crate::controlplane::Environment;
use crate::error::{Error, Result, io_context};
use crate::files::{flag, write_private};
use crate::hostnet;
use crate::images::Images;
use crate::kubeconfig;
use crate::process::{self, ProcessRecord};
use crate::state::NodeComponent;
use crate::wait::{self, Check};

/// How long containerd may take to answer on its socket.
const CONTAINERD_READY: Duration = Duration::from_secs(30);
/// How long a kubelet's node may take to turn Ready (about 14 s measured).
const NODE_READY: Duration = Duration::from_secs(90);
/// How long a cell's controller-manager or scheduler may take to answer `/healthz`.
const DAEMON_READY: Duration = Duration::from_secs(60);
/// How long teardown waits for the kubelet to stop the pods it was asked to delete.
const PODS_GONE: Duration = Duration::from_secs(30);
/// How long teardown waits for killed container processes to leave their cgroups.
const CGROUPS_EMPTY: Duration = Duration::from_secs(15);
/// The longest unix socket path (`sun_path` is 108 bytes with its NUL; containerd adds `.ttrpc`).
const MAX_SOCKET_PATH: usize = 100;
/// The CNI plugins' directory (Debian's containernetworking-plugins).
const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// runc as Debian installs it.
const RUNC: &str = "/usr/sbin/runc";
/// containerd as Debian installs it.
pub const CONTAINERD: &str = "/usr/bin/containerd";
/// containerd's command-line client, for image imports and teardown.
pub const CTR: &str = "/usr/bin/ctr";
/// The containerd namespace the CRI plugin (and so the kubelet) uses.
const CRI_NAMESPACE: &str = "k8s.io";

/// Where a cell's node keeps its files, and its addresses: pods in `198.18.<n>.0/24` behind
/// bridge `repl-<cell>` (gateway `.1`), cgroup root `/replicator-<cell>` in every hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLayout {
    /// The cell.
    pub cell: Cluster,
    /// `<state>/nodes/<cell>`.
    pub dir: PathBuf,
}

impl NodeLayout {
    /// The layout of `cell`'s node in the environment at `state_dir`.
    pub fn new(state_dir: &Path, cell: Cluster) -> NodeLayout {
        NodeLayout {
            cell,
            dir: state_dir.join("nodes").join(cell.name()),
        }
    }

    /// The Node's name: the cell's (`cell-a`).
    pub fn node_name(&self) -> &'static str {
        self.cell.name()
    }

    /// The pod range, `198.18.<n>.0/24`.
    pub fn pod_cidr(&self) -> String {
        format!("198.18.{}.0/24", self.cell.number())
    }

    /// The bridge's address, the pods' gateway: `198.18.<n>.1`.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.cell.number(), 1)
    }

    /// The bridge: `repl-<cell>` (at most 15 characters, the kernel's limit).
    pub fn bridge(&self) -> String {
        format!("repl-{}", self.cell.name())
    }

    /// The kubelet's `cgroupRoot`, without its leading slash: `replicator-<cell>`.
    pub fn cgroup_root(&self) -> String {
        format!("replicator-{}", self.cell.name())
    }

    /// containerd's gRPC socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd").join("containerd.sock")
    }

    /// The kubelet's `--root-dir`.
    pub fn kubelet_dir(&self) -> PathBuf {
        self.dir.join("kubelet")
    }

    /// The directory of the pods' container logs (`podLogsDir`).
    pub fn pod_logs_dir(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }

    fn containerd_config_path(&self) -> PathBuf {
        self.dir.join("containerd.toml")
    }

    fn kubelet_config_path(&self) -> PathBuf {
        self.dir.join("kubelet-config.yaml")
    }

    fn kubelet_kubeconfig_path(&self) -> PathBuf {
        self.dir.join("kubelet.kubeconfig")
    }

    fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni").join("net.d")
    }

    /// containerd's configuration (format version 2, containerd 1.6): everything under the
    /// node's directory, including the pods' network namespaces
    /// (`netns_mounts_under_state_dir`), so teardown finds every mount; debug and metrics
    /// endpoints off; `restrict_oom_score_adj`, because the VM's bounding set lacks
    /// CAP_SYS_RESOURCE and runc could not otherwise set the sandbox's `oom_score_adj` (-998).
    pub fn containerd_config(&self, pause_image: &str) -> String {
        let d = self.dir.display();
        let socket = self.containerd_socket();
        let socket = socket.display();
        format!(
            r#"# Written by the replicator e2e harness for {cell}.
version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        Root = "{d}/runc"
        SystemdCgroup = false

  # No registry is reachable from here, and none may be tried: every pull of an image that was
  # not imported goes to a closed loopback port and fails at once (ErrImagePull), never to the
  # registry its name points at.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{d}/containerd/certs.d"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{d}/cni/net.d"
    max_conf_num = 1
"#,
            cell = self.cell,
        )
    }

    /// The CNI network: a bridge that is the pods' gateway (no masquerade: nothing leaves the
    /// host) with host-local IPAM on the pod range and its own lease directory.
    pub fn cni_config(&self) -> String {
        serde_json::json!({
            "cniVersion": "0.4.0",
            "name": format!("replicator-{}", self.cell.name()),
            "plugins": [{
                "type": "bridge",
                "bridge": self.bridge(),
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": self.pod_cidr(), "gateway": self.gateway().to_string()}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": self.dir.join("cni").join("ipam").display().to_string(),
                },
            }],
        })
        .to_string()
    }

    /// The KubeletConfiguration: cgroupfs driver on the cgroup v1 hierarchies this machine has
    /// (`failCgroupV1: false`), the cell's own cgroup root (two kubelets would otherwise share
    /// `/kubepods`), `oomScoreAdj: 0` (see [`NodeLayout::containerd_config`]), its own ports,
    /// no read-only port, webhook authentication and authorization, and no image garbage
    /// collection or disk eviction (the images are imported, never pulled).
    pub fn kubelet_config(&self, ports: crate::ports::NodePorts, ca_cert: &Path) -> String {
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
cgroupRoot: /{cgroup_root}
cgroupsPerQOS: true
oomScoreAdj: 0
containerRuntimeEndpoint: unix://{socket}
podLogsDir: {logs}
port: {port}
healthzPort: {healthz}
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
registerNode: true
maxPods: 32
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
resolvConf: ""
shutdownGracePeriod: 0s
# A changed Secret reaches a pod's volume on the pod's next sync: 10 s instead of a minute, so
# that the scenarios that fix a Secret wait less (the behaviour is the same).
syncFrequency: 10s
"#,
            cgroup_root = self.cgroup_root(),
            socket = self.containerd_socket().display(),
            logs = self.pod_logs_dir().display(),
            port = ports.kubelet,
            healthz = ports.kubelet_healthz,
            ca = ca_cert.display(),
        )
    }
}

impl Environment {
    /// The address pods and kubelets dial to reach the host's apiservers (see
    /// [`crate::hostnet::primary_address`]).
    pub async fn host_address(&self) -> Result<Ipv4Addr> {
        self.state
            .lock()
            .await
            .host_address
            .ok_or_else(|| Error::Config("the environment recorded no host address".to_owned()))
    }

    /// `https://<host address>:<port>`: a cluster's apiserver as a pod reaches it (a kubeconfig
    /// mounted into a pod must name this, never loopback).
    pub async fn pod_reachable_server_url(&self, cluster: Cluster) -> Result<String> {
        Ok(format!(
            "https://{}:{}",
            self.host_address().await?,
            self.ports.apiserver(cluster)
        ))
    }

    /// Whether the cells run as one-node clusters (kubelets could run when the environment
    /// started; see [`kubelets_possible`]).
    pub async fn has_nodes(&self) -> bool {
        !self.state.lock().await.nodes.is_empty()
    }

    /// The layout of a cell's node.
    pub fn node(&self, cell: Cluster) -> NodeLayout {
        NodeLayout::new(&self.dir, cell)
    }

    /// Brings a cell's node up: configuration files, cgroup root, DNAT rule, containerd (with the
    /// images imported), kube-controller-manager, kube-scheduler and the kubelet; waits until
    /// the Node is Ready.
    pub(crate) async fn start_node(&self, cell: Cluster, images: &Images) -> Result<()> {
        let layout = self.node(cell);
        let ports = self
            .ports
            .node(cell)
            .ok_or_else(|| Error::Config(format!("{cell} is not a cell: it runs no node")))?;
        let host = self.host_address().await?;
        let socket_len = layout.containerd_socket().as_os_str().len() + ".ttrpc".len();
        if socket_len > MAX_SOCKET_PATH {
            return Err(Error::Config(format!(
                "containerd's socket {} would be {socket_len} bytes long, past the {MAX_SOCKET_PATH} a unix socket allows: \
                 put the environment in a shorter directory ({})",
                layout.containerd_socket().display(),
                crate::paths::ENV_DIR_VAR
            )));
        }
        for dir in [
            layout.dir.join("containerd"),
            layout.dir.join("runc"),
            layout.cni_conf_dir(),
            layout.dir.join("cni").join("ipam"),
            layout.kubelet_dir(),
            layout.pod_logs_dir(),
            layout.dir.join("pki"),
        ] {
            std::fs::create_dir_all(&dir).map_err(io_context(format!("creating {}", dir.display())))?;
        }
        hostnet::create_cgroup_root(&layout.cgroup_root())?;
        tracing::info!(%cell, cgroup_root = %layout.cgroup_root(), "cgroup v1: the cell's cgroup root exists in every hierarchy (cpuset inherits its parent's CPUs and memory nodes)");
        write_file(&layout.cni_conf_dir().join("10-bridge.conflist"), &layout.cni_config())?;
        write_file(
            &layout.containerd_config_path(),
            &layout.containerd_config(&images.pause),
        )?;
        let registries = layout.dir.join("containerd").join("certs.d").join("_default");
        std::fs::create_dir_all(&registries).map_err(io_context(format!("creating {}", registries.display())))?;
        write_file(&registries.join("hosts.toml"), NO_REGISTRY)?;
        write_file(
            &layout.kubelet_config_path(),
            &layout.kubelet_config(ports, &self.pki.ca_cert()),
        )?;
        let ca = self.pki.ca_pem().await?;
        let node_cert = self
            .pki
            .issue_client_cert(
                &format!("kubelet-{cell}"),
                &format!("system:node:{}", layout.node_name()),
                "system:nodes",
            )
            .await?;
        write_private(
            &layout.kubelet_kubeconfig_path(),
            &kubeconfig::render_with_certificate(
                cell,
                &self.server_url(cell),
                &ca,
                "kubelet",
                &node_cert.cert,
                &node_cert.key,
            ),
        )?;
        let rule = hostnet::dnat_rule(
            &layout.pod_cidr(),
            cell.kubernetes_service_ip(),
            host,
            self.ports.apiserver(cell),
        );
        hostnet::ensure_nat_rule(&rule).await?;
        tracing::info!(%cell, rule = rule.join(" "), "no kube-proxy: pods reach their apiserver's kubernetes Service IP through one DNAT rule");

        self.start_node_process(
            cell,
            NodeComponent::Containerd,
            &[flag("--config", layout.containerd_config_path())],
        )
        .await?;
        tracing::info!(%cell, socket = %layout.containerd_socket().display(), "containerd of the cell's own (restrict_oom_score_adj: the VM lacks CAP_SYS_RESOURCE)");
        let (url, probe) = self.node_component_probe(cell, NodeComponent::Containerd);
        let containerd = self.node_process(cell, NodeComponent::Containerd).await?;
        self.wait_ready(
            &format!("containerd {cell}"),
            &containerd,
            &url,
            probe,
            CONTAINERD_READY,
        )
        .await?;
        self.import_images(cell, images).await?;

        let cm_kubeconfig = kubeconfig::cell_controller_manager_path(&self.dir, cell);
        let serving = self.pki.apiserver_cert();
        self.start_node_process(
            cell,
            NodeComponent::KubeControllerManager,
            &[
                flag("--kubeconfig", &cm_kubeconfig),
                flag("--controllers", CELL_CONTROLLERS),
                flag("--leader-elect", "false"),
                flag("--use-service-account-credentials", "true"),
                flag("--root-ca-file", self.pki.ca_cert()),
                flag("--service-account-private-key-file", self.pki.service_account_key()),
                flag("--bind-address", "127.0.0.1"),
                flag("--secure-port", ports.controller_manager.to_string()),
                flag("--tls-cert-file", &serving.cert),
                flag("--tls-private-key-file", &serving.key),
            ],
        )
        .await?;
        self.start_node_process(
            cell,
            NodeComponent::KubeScheduler,
            &[
                flag("--kubeconfig", &cm_kubeconfig),
                flag("--leader-elect", "false"),
                flag("--bind-address", "127.0.0.1"),
                flag("--secure-port", ports.scheduler.to_string()),
                flag("--tls-cert-file", &serving.cert),
                flag("--tls-private-key-file", &serving.key),
            ],
        )
        .await?;
        self.start_node_process(
            cell,
            NodeComponent::Kubelet,
            &[
                flag("--config", layout.kubelet_config_path()),
                flag("--kubeconfig", layout.kubelet_kubeconfig_path()),
                flag("--root-dir", layout.kubelet_dir()),
                flag("--cert-dir", layout.dir.join("pki")),
                flag("--hostname-override", layout.node_name()),
                flag("--node-ip", host.to_string()),
            ],
        )
        .await?;
        tracing::info!(%cell, node_ip = %host, "kubelet: node IP is the host's primary address (loopback is refused, and the apiserver dials it for logs and exec)");
        for component in [
            NodeComponent::KubeControllerManager,
            NodeComponent::KubeScheduler,
            NodeComponent::Kubelet,
        ] {
            let process = self.node_process(cell, component).await?;
            let name = format!("{} {cell}", component.name());
            let (url, probe) = self.node_component_probe(cell, component);
            self.wait_ready(&name, &process, &url, probe, DAEMON_READY).await?;
        }
        self.wait_node_ready(cell, NODE_READY).await
    }

    /// The cell's Node: `Ok(())` when its Ready condition is True, otherwise what it says.
    pub async fn node_ready(&self, cell: Cluster) -> std::result::Result<(), String> {
        let client = self.client(cell).await.map_err(|error| error.to_string())?;
        let nodes: Api<NodeObject> = Api::all(client);
        let node = nodes
            .get_opt(self.node(cell).node_name())
            .await
            .map_err(|error| error.to_string())?
            .ok_or_else(|| "not registered".to_owned())?;
        let ready = node
            .status
            .and_then(|status| status.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|condition| condition.type_ == "Ready");
        match ready {
            Some(condition) if condition.status == "True" => Ok(()),
            Some(condition) => Err(format!(
                "Ready={}: {}",
                condition.status,
                condition.message.unwrap_or_default()
            )),
            None => Err("no Ready condition yet".to_owned()),
        }
    }

    /// Waits until a cell's Node is Ready.
    pub async fn wait_node_ready(&self, cell: Cluster, deadline: Duration) -> Result<()> {
        let what = format!("node {} to be Ready", self.node(cell).node_name());
        let kubelet = self.node_process(cell, NodeComponent::Kubelet).await?;
        wait::until_observed(deadline, &what, || {
            let alive = kubelet.is_alive();
            async move {
                if !alive {
                    return Ok::<_, Error>(Check::Abort(format!("the kubelet (pid {}) exited", kubelet.pid)));
                }
                Ok(match self.node_ready(cell).await {
                    Ok(()) => Check::Ready(()),
                    Err(problem) => Check::NotYet(problem),
                })
            }
        })
        .await
        .map_err(|reason| Error::NotReady {
            component: format!("kubelet {cell}"),
            reason: Box::new(reason),
            log: kubelet.log.clone(),
            log_tail: process::log_tail(&kubelet.log, 40),
        })
    }

    /// The product image as the repository builds it now: runs `e2e/scripts/build-image.sh`
    /// (it rebuilds only what changed) and imports what is new into each cell's containerd.
    /// Scenarios that deploy the product call this, so that a changed source is what runs;
    /// [`Environment::ensure_up`] reusing an environment does not (it would cost every scenario
    /// a release-build check).
    ///
    /// # Errors
    /// The environment has no nodes ([`kubelets_possible`] said why at `up`), the build fails,
    /// or an import fails.
    pub async fn ensure_images(&self) -> Result<Images> {
        if !self.has_nodes().await {
            let why = kubelets_possible()
                .err()
                .unwrap_or_else(|| "the environment was started without them".to_owned());
            return Err(Error::Config(format!(
                "the cells run no kubelets ({why}): nothing can run the image"
            )));
        }
        let images = Images::ensure().await?;
        for cell in Cluster::CELLS {
            self.import_images(cell, &images).await?;
        }
        Ok(images)
    }

    /// Imports the pause and product images into a cell's containerd (CRI namespace), unless
    /// the state says they are there already.
    pub(crate) async fn import_images(&self, cell: Cluster, images: &Images) -> Result<()> {
        let imported = self
            .state
            .lock()
            .await
            .imported_images
            .get(&cell)
            .cloned()
            .unwrap_or_default();
        let socket = self.node(cell).containerd_socket();
        for (reference, archive) in images.archives() {
            let archive = archive.as_path();
            if imported.iter().any(|done| done == reference) {
                continue;
            }
            let started = std::time::Instant::now();
            run_checked(
                Command::new(CTR)
                    .arg("--address")
                    .arg(&socket)
                    .args(["-n", CRI_NAMESPACE, "images", "import"])
                    .arg(archive),
            )
            .await?;
            tracing::info!(%cell, image = reference, elapsed = ?started.elapsed(), "image imported into the cell's containerd");
            let mut state = self.state.lock().await;
            state
                .imported_images
                .entry(cell)
                .or_default()
                .push(reference.to_owned());
            state.save(&self.dir)?;
        }
        Ok(())
    }

    async fn start_node_process(&self, cell: Cluster, component: NodeComponent, args: &[OsString]) -> Result<()> {
        let program = match component {
            NodeComponent::Containerd => PathBuf::from(CONTAINERD),
            NodeComponent::KubeControllerManager => self.binaries.kube_controller_manager.clone(),
            NodeComponent::KubeScheduler => self.binaries.kube_scheduler.clone(),
            NodeComponent::Kubelet => self.binaries.kubelet.clone(),
        };
        let log = self.logs_dir().join(format!("{}-{cell}.log", component.name()));
        tracing::info!(%cell, component = component.name(), "starting");
        let process = process::spawn_detached(&program, args, &log)?;
        let mut state = self.state.lock().await;
        state.nodes.entry(cell).or_default().insert(component, process);
        state.save(&self.dir)
    }

    pub(crate) async fn node_process(&self, cell: Cluster, component: NodeComponent) -> Result<ProcessRecord> {
        self.state
            .lock()
            .await
            .nodes
            .get(&cell)
            .and_then(|components| components.get(&component))
            .cloned()
            .ok_or_else(|| Error::Config(format!("{} of {cell} was never started", component.name())))
    }

    /// The URL `status` probes for a node component, and how (containerd has no HTTP endpoint:
    /// its URL names the socket, see [`containerd_answers`]).
    pub(crate) fn node_component_probe(
        &self,
        cell: Cluster,
        component: NodeComponent,
    ) -> (String, crate::daemon::Probe) {
        let ports = self.ports.node(cell).unwrap_or(self.ports.cell_a_node);
        let url = match component {
            NodeComponent::Containerd => format!("unix://{}", self.node(cell).containerd_socket().display()),
            NodeComponent::KubeControllerManager => format!("https://127.0.0.1:{}/healthz", ports.controller_manager),
            NodeComponent::KubeScheduler => format!("https://127.0.0.1:{}/healthz", ports.scheduler),
            NodeComponent::Kubelet => format!("http://127.0.0.1:{}/healthz", ports.kubelet_healthz),
        };
        let probe = match component {
            NodeComponent::Containerd => crate::daemon::Probe::ContainerdSocket,
            _ => crate::daemon::Probe::Ok200,
        };
        (url, probe)
    }

    /// Asks each cell's kubelet to stop every pod: deletes them through the API with no grace
    /// period (their controllers already stopped) and waits, up to a deadline, until the cell's
    /// containerd runs no container. Best effort: teardown kills whatever is left.
    pub(crate) async fn drain_nodes(&self) {
        for cell in Cluster::CELLS {
            let Ok(client) = self.client(cell).await else { continue };
            let pods: Api<Pod> = Api::all(client.clone());
            let Ok(list) = pods.list(&ListParams::default()).await else {
                continue;
            };
            for pod in list.items {
                let (Some(namespace), Some(name)) = (pod.metadata.namespace.clone(), pod.metadata.name.clone()) else {
                    continue;
                };
                let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
                let _ = api.delete(&name, &DeleteParams::default().grace_period(0)).await;
            }
            let socket = self.node(cell).containerd_socket();
            let _ = wait::until(PODS_GONE, &format!("{cell}'s containers to stop"), || {
                let socket = socket.clone();
                async move {
                    let output = run(Command::new(CTR).arg("--address").arg(&socket).args([
                        "-n",
                        CRI_NAMESPACE,
                        "tasks",
                        "ls",
                        "-q",
                    ]))
                    .await?;
                    Ok::<_, Error>((!output.status.success() || output.stdout.trim_ascii().is_empty()).then_some(()))
                }
            })
            .await;
        }
    }
}

/// containerd's `hosts.toml` for every registry (`certs.d/_default`): the only server is a
/// loopback port nothing listens on, so a pull fails at once and no packet leaves the host.
/// (containerd 1.6 refuses a file with `server` alone: "invalid `host` tree".)
pub const NO_REGISTRY: &str = "# Written by the replicator e2e harness: no registry is reachable, none is tried.\n\
                               server = \"http://127.0.0.1:1\"\n\n\
                               [host.\"http://127.0.0.1:1\"]\n  capabilities = [\"pull\", \"resolve\"]\n";

/// Whether the containerd on `socket` answers `ctr version`: `Err` with what ctr said.
pub(crate) async fn containerd_answers(socket: &Path) -> std::result::Result<(), String> {
    match run(Command::new(CTR).arg("--address").arg(socket).arg("version")).await {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => Err(crate::command::combined_output(&output)),
        Err(error) => Err(error.to_string()),
    }
}

/// Whether kubelets can run on this machine: `Err` says why not, in one line (not root; no
/// writable cgroup hierarchy under `/sys/fs/cgroup`). Without them the cells are bare
/// apiservers, as before, and the product runs as processes.
pub fn kubelets_possible() -> std::result::Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err(
            "kubelets need root (containerd, cgroups, network namespaces); this process is not root".to_owned(),
        );
    }
    let hierarchies = hostnet::cgroup_hierarchies().map_err(|error| error.to_string())?;
    if hierarchies.is_empty() {
        return Err("no cgroup hierarchy is mounted under /sys/fs/cgroup".to_owned());
    }
    if let Some(read_only) = hierarchies
        .iter()
        .find(|dir| nix::unistd::access(dir.as_path(), nix::unistd::AccessFlags::W_OK).is_err())
    {
        return Err(format!("cgroup hierarchy {} is not writable", read_only.display()));
    }
    Ok(())
}

/// Runs `e2e/scripts/install-host-packages.sh`: containerd, runc, the CNI plugins, iptables,
/// iproute2 and buildah from Debian when one is missing (it says what it installs).
pub async fn ensure_host_packages() -> Result<()> {
    let script = crate::paths::workspace_root()
        .join("e2e")
        .join("scripts")
        .join("install-host-packages.sh");
    crate::command::run_streamed(Command::new("bash").arg(&script)).await
}

/// The controllers a cell's kube-controller-manager runs: workloads (Deployments, ReplicaSets,
/// PodDisruptionBudgets), namespaces and garbage collection, service accounts and their tokens,
/// the root CA ConfigMap pods mount, Services' endpoints, and pod garbage collection.
pub const CELL_CONTROLLERS: &str = "deployment-controller,replicaset-controller,disruption-controller,namespace-controller,garbage-collector-controller,serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,endpoints-controller,endpointslice-controller,pod-garbage-collector-controller,node-lifecycle-controller,taint-eviction-controller";

/// Removes everything the cells' nodes leave on the host, whether or not their processes were
/// stopped cleanly: the processes still in a cell's cgroups (SIGKILL), every mount under the
/// nodes' directory, the cgroup roots, the bridges, the harness's NAT rules and the kubelets'
/// chains, and `ip_forward` back to `ip_forward_before`. Each step logs what it removed.
pub(crate) async fn clean_host(state_dir: &Path, ip_forward_before: Option<&str>) -> Result<()> {
    if let Some(owner) = nodes_owner().filter(|owner| owner != state_dir) {
        // The cgroups, bridges and rules are the host's, not this directory's: another
        // environment's nodes use them now. Leave them alone.
        tracing::info!(owner = %owner.display(), "the cells' nodes belong to another environment; leaving the host as it is");
        return Ok(());
    }
    for cell in Cluster::CELLS {
        let layout = NodeLayout::new(state_dir, cell);
        let root = layout.cgroup_root();
        let pids = hostnet::cgroup_processes(&root)?;
        if !pids.is_empty() {
            tracing::info!(%cell, ?pids, "killing the processes left in the cell's cgroups");
            for pid in &pids {
                if let Ok(pid) = i32::try_from(*pid) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
            wait::until(CGROUPS_EMPTY, &format!("the cgroups of {cell} to empty"), || {
                let root = root.clone();
                async move {
                    let left = hostnet::cgroup_processes(&root)?;
                    Ok::<_, Error>(left.is_empty().then_some(()))
                }
            })
            .await?;
        }
    }
    let nodes_dir = state_dir.join("nodes");
    let unmounted = hostnet::unmount_all_under(&nodes_dir)?;
    if !unmounted.is_empty() {
        tracing::info!(
            count = unmounted.len(),
            "unmounted what the kubelets and containerds left"
        );
    }
    for cell in Cluster::CELLS {
        let layout = NodeLayout::new(state_dir, cell);
        let removed = hostnet::remove_cgroup_root(&layout.cgroup_root())?;
        if !removed.is_empty() {
            tracing::info!(%cell, count = removed.len(), "removed the cell's cgroups");
        }
        if hostnet::delete_link(&layout.bridge()).await? {
            tracing::info!(%cell, bridge = layout.bridge(), "deleted the cell's bridge");
        }
    }
    for removed in hostnet::remove_rules_and_kubelet_chains().await? {
        tracing::info!(removed, "removed an iptables rule or chain");
    }
    if let Some(value) = ip_forward_before
        && hostnet::ip_forward()? != value
    {
        hostnet::restore_ip_forward(value)?;
        tracing::info!(value, "restored net.ipv4.ip_forward");
    }
    match std::fs::remove_file(NODES_OWNER) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_context(format!("removing {NODES_OWNER}"))(error)),
    }
}

/// The file naming the state directory of the environment whose nodes hold the host's cell
/// cgroups, bridges, pod ranges and NAT rules (they are one per machine, whatever the ports).
const NODES_OWNER: &str = "/run/replicator-e2e/nodes-owner";

/// The state directory of the environment whose nodes hold the host now, if any.
pub(crate) fn nodes_owner() -> Option<PathBuf> {
    std::fs::read_to_string(NODES_OWNER)
        .ok()
        .map(|text| PathBuf::from(text.trim()))
        .filter(|dir| !dir.as_os_str().is_empty())
}

/// Fails when another environment's nodes hold the host and that environment is running: its
/// `state.json` records a process that is still alive (same pid and start time). Forgets an
/// owner whose environment is gone, and one whose state file outlived its processes (a machine
/// restored from a snapshot of a running environment, a reboot, a SIGKILLed harness): nothing
/// runs there, so this environment's teardown may clean the host.
pub(crate) fn check_nodes_free(state_dir: &Path) -> Result<()> {
    if let Some(owner) = nodes_owner().filter(|owner| owner != state_dir) {
        let running = crate::state::State::running_in(&owner);
        if !running.is_empty() {
            return Err(Error::Config(format!(
                "the cells' kubelets, cgroups, bridges and NAT rules are one per machine, and the environment at {} holds them ({} running): stop it first (replicator-env --dir {} down)",
                owner.display(),
                running.join(", "),
                owner.display()
            )));
        }
        tracing::info!(owner = %owner.display(), "the environment that held the cells' nodes runs no process; taking them over");
        std::fs::remove_file(NODES_OWNER).map_err(io_context(format!("removing {NODES_OWNER}")))?;
    }
    Ok(())
}

/// Records `state_dir` as the environment whose nodes hold the host (see [`check_nodes_free`]).
pub(crate) fn record_nodes_owner(state_dir: &Path) -> Result<()> {
    let parent = Path::new(NODES_OWNER).parent().unwrap_or(Path::new("/run"));
    std::fs::create_dir_all(parent).map_err(io_context(format!("creating {}", parent.display())))?;
    std::fs::write(NODES_OWNER, state_dir.display().to_string()).map_err(io_context(format!("writing {NODES_OWNER}")))
}

fn write_file(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).map_err(io_context(format!("writing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_get_apart_addresses_bridges_and_cgroups() {
        let a = NodeLayout::new(Path::new("/env"), Cluster::CellA);
        let b = NodeLayout::new(Path::new("/env"), Cluster::CellB);
        assert_eq!(a.pod_cidr(), "198.18.1.0/24");
        assert_eq!(b.gateway(), Ipv4Addr::new(198, 18, 2, 1));
        assert_eq!(a.bridge(), "repl-cell-a");
        assert!(a.bridge().len() <= 15 && b.bridge().len() <= 15);
        assert_ne!(a.cgroup_root(), b.cgroup_root());
        assert_eq!(
            a.containerd_socket(),
            PathBuf::from("/env/nodes/cell-a/containerd/containerd.sock")
        );
    }

    #[test]
    fn containerd_config_keeps_everything_under_the_node_directory() {
        let a = NodeLayout::new(Path::new("/env"), Cluster::CellA);
        let text = a.containerd_config("localhost/pause:1");
        for needle in [
            "root = \"/env/nodes/cell-a/containerd/root\"",
            "state = \"/env/nodes/cell-a/containerd/state\"",
            "address = \"/env/nodes/cell-a/containerd/containerd.sock\"",
            "address = \"/env/nodes/cell-a/containerd/containerd.sock.ttrpc\"",
            "Root = \"/env/nodes/cell-a/runc\"",
            "restrict_oom_score_adj = true",
            "netns_mounts_under_state_dir = true",
            "config_path = \"/env/nodes/cell-a/containerd/certs.d\"",
            "sandbox_image = \"localhost/pause:1\"",
            "conf_dir = \"/env/nodes/cell-a/cni/net.d\"",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }

    #[test]
    fn cni_and_kubelet_configs_name_the_cell() -> anyhow::Result<()> {
        let b = NodeLayout::new(Path::new("/env"), Cluster::CellB);
        let cni: serde_json::Value = serde_json::from_str(&b.cni_config())?;
        assert_eq!(cni["plugins"][0]["bridge"], "repl-cell-b");
        assert_eq!(cni["plugins"][0]["ipMasq"], false);
        assert_eq!(cni["plugins"][0]["ipam"]["ranges"][0][0]["subnet"], "198.18.2.0/24");
        let ports = crate::ports::Ports::default().cell_b_node;
        let kubelet: serde_json::Value =
            serde_saphyr::from_str(&b.kubelet_config(ports, Path::new("/env/pki/ca.crt")))?;
        assert_eq!(kubelet["cgroupRoot"], "/replicator-cell-b");
        assert_eq!(kubelet["oomScoreAdj"], 0);
        assert_eq!(kubelet["failCgroupV1"], false);
        assert_eq!(kubelet["readOnlyPort"], 0);
        assert_eq!(kubelet["port"], u64::from(ports.kubelet));
        assert_eq!(kubelet["authorization"]["mode"], "Webhook");
        Ok(())
    }
}
