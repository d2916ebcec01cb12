//! The environment's fixed loopback ports, in one place.
//!
//! Each default can be overridden with an environment variable when the environment is started
//! fresh; a running environment's ports are read back from its `state.json`.

use serde::{Deserialize, Serialize};

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::paths::non_empty_var;

/// etcd's client port (`REPLICATOR_ETCD_PORT`).
pub const ETCD_CLIENT_PORT: u16 = 23790;
/// etcd's peer port (`REPLICATOR_ETCD_PEER_PORT`).
pub const ETCD_PEER_PORT: u16 = 23800;
/// The hub kube-apiserver's secure port (`REPLICATOR_HUB_PORT`).
pub const HUB_PORT: u16 = 16443;
/// The cell-a kube-apiserver's secure port (`REPLICATOR_CELL_A_PORT`).
pub const CELL_A_PORT: u16 = 16444;
/// The cell-b kube-apiserver's secure port (`REPLICATOR_CELL_B_PORT`).
pub const CELL_B_PORT: u16 = 16445;
/// The hub kube-controller-manager's secure (health) port (`REPLICATOR_KCM_PORT`).
pub const CONTROLLER_MANAGER_PORT: u16 = 16457;

/// The set of ports one environment uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ports {
    /// etcd's client port.
    pub etcd_client: u16,
    /// etcd's peer port.
    pub etcd_peer: u16,
    /// The hub apiserver's port.
    pub hub: u16,
    /// The cell-a apiserver's port.
    pub cell_a: u16,
    /// The cell-b apiserver's port.
    pub cell_b: u16,
    /// kube-controller-manager's health port.
    pub controller_manager: u16,
}

impl Default for Ports {
    fn default() -> Self {
        Ports {
            etcd_client: ETCD_CLIENT_PORT,
            etcd_peer: ETCD_PEER_PORT,
            hub: HUB_PORT,
            cell_a: CELL_A_PORT,
            cell_b: CELL_B_PORT,
            controller_manager: CONTROLLER_MANAGER_PORT,
        }
    }
}

impl Ports {
    /// The defaults, each overridden by its environment variable when set.
    pub fn from_env() -> Result<Ports> {
        let defaults = Ports::default();
        let ports = Ports {
            etcd_client: port_var("REPLICATOR_ETCD_PORT", defaults.etcd_client)?,
            etcd_peer: port_var("REPLICATOR_ETCD_PEER_PORT", defaults.etcd_peer)?,
            hub: port_var("REPLICATOR_HUB_PORT", defaults.hub)?,
            cell_a: port_var("REPLICATOR_CELL_A_PORT", defaults.cell_a)?,
            cell_b: port_var("REPLICATOR_CELL_B_PORT", defaults.cell_b)?,
            controller_manager: port_var("REPLICATOR_KCM_PORT", defaults.controller_manager)?,
        };
        let all = ports.all();
        for (i, (name, port)) in all.iter().enumerate() {
            if let Some((other, _)) = all[i + 1..].iter().find(|(_, p)| p == port) {
                return Err(Error::Config(format!(
                    "{name} and {other} are both configured to use port {port}"
                )));
            }
        }
        Ok(ports)
    }

    /// The secure port of a cluster's apiserver.
    pub fn apiserver(&self, cluster: Cluster) -> u16 {
        match cluster {
            Cluster::Hub => self.hub,
            Cluster::CellA => self.cell_a,
            Cluster::CellB => self.cell_b,
        }
    }

    /// Every port with the name of the component using it.
    pub fn all(&self) -> [(&'static str, u16); 6] {
        [
            ("etcd (client)", self.etcd_client),
            ("etcd (peer)", self.etcd_peer),
            ("kube-apiserver hub", self.hub),
            ("kube-apiserver cell-a", self.cell_a),
            ("kube-apiserver cell-b", self.cell_b),
            ("kube-controller-manager", self.controller_manager),
        ]
    }
}

fn port_var(name: &str, default: u16) -> Result<u16> {
    match non_empty_var(name) {
        None => Ok(default),
        Some(value) => value
            .to_str()
            .and_then(|text| text.parse::<u16>().ok())
            .filter(|port| *port != 0)
            .ok_or_else(|| Error::Config(format!("{name}={value:?} is not a port number"))),
    }
}
