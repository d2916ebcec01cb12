//! The environment's fixed loopback ports, in one place.
//!
//! Each default can be overridden with an environment variable when the environment is started
//! fresh; a running environment's ports are read back from its `state.json`. Every Karmada
//! component gets its own ports (their upstream defaults, `:8080` for metrics above all, clash).

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
/// The edge-1 kube-apiserver's secure port (`REPLICATOR_EDGE_1_PORT`).
pub const EDGE_1_PORT: u16 = 16446;
/// The hub kube-controller-manager's secure (health) port (`REPLICATOR_KCM_PORT`).
pub const CONTROLLER_MANAGER_PORT: u16 = 16457;
/// karmada-aggregated-apiserver's secure port (`REPLICATOR_KARMADA_AGGREGATED_APISERVER_PORT`).
pub const KARMADA_AGGREGATED_APISERVER_PORT: u16 = 16460;
/// karmada-webhook's secure port (`REPLICATOR_KARMADA_WEBHOOK_PORT`).
pub const KARMADA_WEBHOOK_PORT: u16 = 16461;
/// karmada-webhook's metrics port (`REPLICATOR_KARMADA_WEBHOOK_METRICS_PORT`).
pub const KARMADA_WEBHOOK_METRICS_PORT: u16 = 16462;
/// karmada-webhook's health port (`REPLICATOR_KARMADA_WEBHOOK_HEALTH_PORT`).
pub const KARMADA_WEBHOOK_HEALTH_PORT: u16 = 16463;
/// karmada-controller-manager's metrics port (`REPLICATOR_KARMADA_CM_METRICS_PORT`).
pub const KARMADA_CONTROLLER_MANAGER_METRICS_PORT: u16 = 16464;
/// karmada-controller-manager's health port (`REPLICATOR_KARMADA_CM_HEALTH_PORT`).
pub const KARMADA_CONTROLLER_MANAGER_HEALTH_PORT: u16 = 16465;
/// karmada-scheduler's metrics port (`REPLICATOR_KARMADA_SCHEDULER_METRICS_PORT`).
pub const KARMADA_SCHEDULER_METRICS_PORT: u16 = 16466;
/// karmada-scheduler's health port (`REPLICATOR_KARMADA_SCHEDULER_HEALTH_PORT`).
pub const KARMADA_SCHEDULER_HEALTH_PORT: u16 = 16467;

/// First of the cells' node ports: kubelet, kubelet healthz, kube-controller-manager and
/// kube-scheduler of cell-a, then the same four of cell-b (`REPLICATOR_NODE_PORT_BASE`).
pub const NODE_PORT_BASE: u16 = 16470;

/// The ports of one cell's node components.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePorts {
    /// The kubelet's API (`port`): logs, exec, its metrics.
    pub kubelet: u16,
    /// The kubelet's `healthzPort` (on loopback).
    pub kubelet_healthz: u16,
    /// The cell's kube-controller-manager secure (health) port.
    pub controller_manager: u16,
    /// The cell's kube-scheduler secure (health) port.
    pub scheduler: u16,
}

impl NodePorts {
    /// The four ports starting at `base`.
    fn from_base(base: u16) -> NodePorts {
        NodePorts {
            kubelet: base,
            kubelet_healthz: base + 1,
            controller_manager: base + 2,
            scheduler: base + 3,
        }
    }
}

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
    /// The edge-1 apiserver's port.
    pub edge_1: u16,
    /// kube-controller-manager's health port.
    pub controller_manager: u16,
    /// karmada-aggregated-apiserver's secure port.
    pub karmada_aggregated_apiserver: u16,
    /// karmada-webhook's secure port.
    pub karmada_webhook: u16,
    /// karmada-webhook's metrics port.
    pub karmada_webhook_metrics: u16,
    /// karmada-webhook's health port.
    pub karmada_webhook_health: u16,
    /// karmada-controller-manager's metrics port.
    pub karmada_controller_manager_metrics: u16,
    /// karmada-controller-manager's health port.
    pub karmada_controller_manager_health: u16,
    /// karmada-scheduler's metrics port.
    pub karmada_scheduler_metrics: u16,
    /// karmada-scheduler's health port.
    pub karmada_scheduler_health: u16,
    /// cell-a's node components.
    pub cell_a_node: NodePorts,
    /// cell-b's node components.
    pub cell_b_node: NodePorts,
}

impl Default for Ports {
    fn default() -> Self {
        Ports {
            etcd_client: ETCD_CLIENT_PORT,
            etcd_peer: ETCD_PEER_PORT,
            hub: HUB_PORT,
            cell_a: CELL_A_PORT,
            cell_b: CELL_B_PORT,
            edge_1: EDGE_1_PORT,
            controller_manager: CONTROLLER_MANAGER_PORT,
            karmada_aggregated_apiserver: KARMADA_AGGREGATED_APISERVER_PORT,
            karmada_webhook: KARMADA_WEBHOOK_PORT,
            karmada_webhook_metrics: KARMADA_WEBHOOK_METRICS_PORT,
            karmada_webhook_health: KARMADA_WEBHOOK_HEALTH_PORT,
            karmada_controller_manager_metrics: KARMADA_CONTROLLER_MANAGER_METRICS_PORT,
            karmada_controller_manager_health: KARMADA_CONTROLLER_MANAGER_HEALTH_PORT,
            karmada_scheduler_metrics: KARMADA_SCHEDULER_METRICS_PORT,
            karmada_scheduler_health: KARMADA_SCHEDULER_HEALTH_PORT,
            cell_a_node: NodePorts::from_base(NODE_PORT_BASE),
            cell_b_node: NodePorts::from_base(NODE_PORT_BASE + 4),
        }
    }
}

impl Ports {
    /// The defaults shifted by `$REPLICATOR_PORT_OFFSET` (0 when unset), each overridden by its
    /// environment variable when set. The offset lets a second environment run beside the first.
    pub fn from_env() -> Result<Ports> {
        let d = Ports::default().shifted(port_offset()?)?;
        let ports = Ports {
            etcd_client: port_var("REPLICATOR_ETCD_PORT", d.etcd_client)?,
            etcd_peer: port_var("REPLICATOR_ETCD_PEER_PORT", d.etcd_peer)?,
            hub: port_var("REPLICATOR_HUB_PORT", d.hub)?,
            cell_a: port_var("REPLICATOR_CELL_A_PORT", d.cell_a)?,
            cell_b: port_var("REPLICATOR_CELL_B_PORT", d.cell_b)?,
            edge_1: port_var("REPLICATOR_EDGE_1_PORT", d.edge_1)?,
            controller_manager: port_var("REPLICATOR_KCM_PORT", d.controller_manager)?,
            karmada_aggregated_apiserver: port_var(
                "REPLICATOR_KARMADA_AGGREGATED_APISERVER_PORT",
                d.karmada_aggregated_apiserver,
            )?,
            karmada_webhook: port_var("REPLICATOR_KARMADA_WEBHOOK_PORT", d.karmada_webhook)?,
            karmada_webhook_metrics: port_var("REPLICATOR_KARMADA_WEBHOOK_METRICS_PORT", d.karmada_webhook_metrics)?,
            karmada_webhook_health: port_var("REPLICATOR_KARMADA_WEBHOOK_HEALTH_PORT", d.karmada_webhook_health)?,
            karmada_controller_manager_metrics: port_var(
                "REPLICATOR_KARMADA_CM_METRICS_PORT",
                d.karmada_controller_manager_metrics,
            )?,
            karmada_controller_manager_health: port_var(
                "REPLICATOR_KARMADA_CM_HEALTH_PORT",
                d.karmada_controller_manager_health,
            )?,
            karmada_scheduler_metrics: port_var(
                "REPLICATOR_KARMADA_SCHEDULER_METRICS_PORT",
                d.karmada_scheduler_metrics,
            )?,
            karmada_scheduler_health: port_var("REPLICATOR_KARMADA_SCHEDULER_HEALTH_PORT", d.karmada_scheduler_health)?,
            cell_a_node: d.cell_a_node,
            cell_b_node: d.cell_b_node,
        };
        let ports = match non_empty_var("REPLICATOR_NODE_PORT_BASE") {
            None => ports,
            Some(_) => {
                let base = port_var("REPLICATOR_NODE_PORT_BASE", NODE_PORT_BASE)?;
                let last = base.checked_add(7).ok_or_else(|| {
                    Error::Config(format!("REPLICATOR_NODE_PORT_BASE={base} leaves no room for 8 ports"))
                })?;
                Ports {
                    cell_a_node: NodePorts::from_base(base),
                    cell_b_node: NodePorts::from_base(last - 3),
                    ..ports
                }
            }
        };
        ports.check_distinct()?;
        Ok(ports)
    }

    /// Every port plus `offset`.
    ///
    /// # Errors
    /// A port would pass 65535.
    pub fn shifted(self, offset: u16) -> Result<Ports> {
        let add = |p: u16| {
            p.checked_add(offset)
                .ok_or_else(|| Error::Config(format!("REPLICATOR_PORT_OFFSET={offset} moves port {p} past 65535")))
        };
        Ok(Ports {
            etcd_client: add(self.etcd_client)?,
            etcd_peer: add(self.etcd_peer)?,
            hub: add(self.hub)?,
            cell_a: add(self.cell_a)?,
            cell_b: add(self.cell_b)?,
            edge_1: add(self.edge_1)?,
            controller_manager: add(self.controller_manager)?,
            karmada_aggregated_apiserver: add(self.karmada_aggregated_apiserver)?,
            karmada_webhook: add(self.karmada_webhook)?,
            karmada_webhook_metrics: add(self.karmada_webhook_metrics)?,
            karmada_webhook_health: add(self.karmada_webhook_health)?,
            karmada_controller_manager_metrics: add(self.karmada_controller_manager_metrics)?,
            karmada_controller_manager_health: add(self.karmada_controller_manager_health)?,
            karmada_scheduler_metrics: add(self.karmada_scheduler_metrics)?,
            karmada_scheduler_health: add(self.karmada_scheduler_health)?,
            cell_a_node: NodePorts {
                kubelet: add(self.cell_a_node.kubelet)?,
                kubelet_healthz: add(self.cell_a_node.kubelet_healthz)?,
                controller_manager: add(self.cell_a_node.controller_manager)?,
                scheduler: add(self.cell_a_node.scheduler)?,
            },
            cell_b_node: NodePorts {
                kubelet: add(self.cell_b_node.kubelet)?,
                kubelet_healthz: add(self.cell_b_node.kubelet_healthz)?,
                controller_manager: add(self.cell_b_node.controller_manager)?,
                scheduler: add(self.cell_b_node.scheduler)?,
            },
        })
    }

    /// Fails if two components are configured to use the same port.
    pub fn check_distinct(&self) -> Result<()> {
        let all = self.all();
        for (i, (name, port)) in all.iter().enumerate() {
            if let Some((other, _)) = all[i + 1..].iter().find(|(_, p)| p == port) {
                return Err(Error::Config(format!(
                    "{name} and {other} are both configured to use port {port}"
                )));
            }
        }
        Ok(())
    }

    /// The secure port of a cluster's apiserver.
    pub fn apiserver(&self, cluster: Cluster) -> u16 {
        match cluster {
            Cluster::Hub => self.hub,
            Cluster::CellA => self.cell_a,
            Cluster::CellB => self.cell_b,
            Cluster::Edge1 => self.edge_1,
        }
    }

    /// The node ports of a cell; `None` for the hub and edge-1 (they run no kubelet).
    pub fn node(&self, cluster: Cluster) -> Option<NodePorts> {
        match cluster {
            Cluster::CellA => Some(self.cell_a_node),
            Cluster::CellB => Some(self.cell_b_node),
            Cluster::Hub | Cluster::Edge1 => None,
        }
    }

    /// Every port with the name of the component using it.
    pub fn all(&self) -> [(&'static str, u16); 23] {
        [
            ("etcd (client)", self.etcd_client),
            ("etcd (peer)", self.etcd_peer),
            ("kube-apiserver hub", self.hub),
            ("kube-apiserver cell-a", self.cell_a),
            ("kube-apiserver cell-b", self.cell_b),
            ("kube-apiserver edge-1", self.edge_1),
            ("kube-controller-manager", self.controller_manager),
            ("karmada-aggregated-apiserver", self.karmada_aggregated_apiserver),
            ("karmada-webhook", self.karmada_webhook),
            ("karmada-webhook (metrics)", self.karmada_webhook_metrics),
            ("karmada-webhook (health)", self.karmada_webhook_health),
            (
                "karmada-controller-manager (metrics)",
                self.karmada_controller_manager_metrics,
            ),
            (
                "karmada-controller-manager (health)",
                self.karmada_controller_manager_health,
            ),
            ("karmada-scheduler (metrics)", self.karmada_scheduler_metrics),
            ("karmada-scheduler (health)", self.karmada_scheduler_health),
            ("kubelet cell-a", self.cell_a_node.kubelet),
            ("kubelet cell-a (healthz)", self.cell_a_node.kubelet_healthz),
            ("kube-controller-manager cell-a", self.cell_a_node.controller_manager),
            ("kube-scheduler cell-a", self.cell_a_node.scheduler),
            ("kubelet cell-b", self.cell_b_node.kubelet),
            ("kubelet cell-b (healthz)", self.cell_b_node.kubelet_healthz),
            ("kube-controller-manager cell-b", self.cell_b_node.controller_manager),
            ("kube-scheduler cell-b", self.cell_b_node.scheduler),
        ]
    }
}

/// `$REPLICATOR_PORT_OFFSET`: added to every default port (0 when unset).
fn port_offset() -> Result<u16> {
    match non_empty_var("REPLICATOR_PORT_OFFSET") {
        None => Ok(0),
        Some(value) => value
            .to_str()
            .and_then(|text| text.parse::<u16>().ok())
            .ok_or_else(|| Error::Config(format!("REPLICATOR_PORT_OFFSET={value:?} is not a number"))),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_distinct() -> anyhow::Result<()> {
        Ports::default().check_distinct()?;
        Ok(())
    }

    #[test]
    fn an_offset_moves_every_port_and_overflow_is_an_error() -> anyhow::Result<()> {
        let moved = Ports::default().shifted(100)?;
        assert_eq!(moved.hub, HUB_PORT + 100);
        assert_eq!(moved.etcd_client, ETCD_CLIENT_PORT + 100);
        assert_eq!(moved.karmada_scheduler_health, KARMADA_SCHEDULER_HEALTH_PORT + 100);
        assert_eq!(moved.cell_b_node.scheduler, NODE_PORT_BASE + 7 + 100);
        moved.check_distinct()?;
        assert!(Ports::default().shifted(60000).is_err());
        Ok(())
    }

    #[test]
    fn a_clash_is_reported() {
        let ports = Ports {
            karmada_scheduler_metrics: KARMADA_WEBHOOK_METRICS_PORT,
            ..Ports::default()
        };
        assert!(ports.check_distinct().is_err());
    }
}
