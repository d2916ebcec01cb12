//! The four clusters of the environment: the hub (the Karmada control plane), two cells and a
//! gateway-only member.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// One of the environment's kube-apiservers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cluster {
    /// The hub, where the replicator mirrors objects to: the Karmada apiserver (it also runs
    /// kube-controller-manager and the Karmada components).
    Hub,
    /// The first cell (location `dfw`); a Karmada member.
    CellA,
    /// The second cell (location `sjc`); a Karmada member.
    CellB,
    /// A gateway-only cluster: a Karmada member that is not a cell.
    Edge1,
}

/// The hub cluster.
pub const HUB: Cluster = Cluster::Hub;
/// The first cell cluster.
pub const CELL_A: Cluster = Cluster::CellA;
/// The second cell cluster.
pub const CELL_B: Cluster = Cluster::CellB;
/// The gateway-only member cluster.
pub const EDGE_1: Cluster = Cluster::Edge1;

impl Cluster {
    /// All clusters, hub first.
    pub const ALL: [Cluster; 4] = [Cluster::Hub, Cluster::CellA, Cluster::CellB, Cluster::Edge1];

    /// The cells (each runs a replicator in the scenarios).
    pub const CELLS: [Cluster; 2] = [Cluster::CellA, Cluster::CellB];

    /// The Karmada member clusters (registered in push mode, all of them gateways).
    pub const MEMBERS: [Cluster; 3] = [Cluster::CellA, Cluster::CellB, Cluster::Edge1];

    /// The cluster's name: `hub`, `cell-a`, `cell-b` or `edge-1`; also the name of its Karmada
    /// `Cluster` object.
    pub fn name(self) -> &'static str {
        match self {
            Cluster::Hub => "hub",
            Cluster::CellA => "cell-a",
            Cluster::CellB => "cell-b",
            Cluster::Edge1 => "edge-1",
        }
    }

    /// The etcd key prefix this cluster's apiserver stores under (`/hub`, `/cell-a`, ...).
    pub fn etcd_prefix(self) -> &'static str {
        match self {
            Cluster::Hub => "/hub",
            Cluster::CellA => "/cell-a",
            Cluster::CellB => "/cell-b",
            Cluster::Edge1 => "/edge-1",
        }
    }

    /// The location of a cell (`dfw` for cell-a, `sjc` for cell-b), carried by its Karmada
    /// `Cluster` as label `topology.datum.net/location`; `None` for the hub and edge-1.
    pub fn location(self) -> Option<&'static str> {
        match self {
            Cluster::CellA => Some("dfw"),
            Cluster::CellB => Some("sjc"),
            Cluster::Hub | Cluster::Edge1 => None,
        }
    }

    /// The cluster's number in the address plan: 0 for the hub, 1 and 2 for the cells, 3 for
    /// edge-1. Every address the harness hands out lies in the benchmarking range 198.18.0.0/15
    /// (never a private range): services in `198.19.<n>.0/24`, a cell's pods in `198.18.<n>.0/24`.
    pub fn number(self) -> u8 {
        match self {
            Cluster::Hub => 0,
            Cluster::CellA => 1,
            Cluster::CellB => 2,
            Cluster::Edge1 => 3,
        }
    }

    /// The apiserver's `--service-cluster-ip-range`: `198.19.<n>.0/24`.
    pub fn service_cidr(self) -> String {
        format!("198.19.{}.0/24", self.number())
    }

    /// The ClusterIP of the cluster's `kubernetes` Service (the first address of
    /// [`Cluster::service_cidr`]), which in-cluster clients dial: `198.19.<n>.1`.
    pub fn kubernetes_service_ip(self) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::new(198, 19, self.number(), 1)
    }

    /// Whether this is one of the cells (cell-a or cell-b).
    pub fn is_cell(self) -> bool {
        matches!(self, Cluster::CellA | Cluster::CellB)
    }

    /// Whether this cluster is a Karmada member (every cluster but the hub).
    pub fn is_member(self) -> bool {
        self != Cluster::Hub
    }
}

impl fmt::Display for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Cluster {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Cluster::ALL
            .into_iter()
            .find(|cluster| cluster.name() == name)
            .ok_or_else(|| Error::UnknownCluster(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() -> anyhow::Result<()> {
        for cluster in Cluster::ALL {
            assert_eq!(cluster.name().parse::<Cluster>()?, cluster);
        }
        assert!("cell-c".parse::<Cluster>().is_err());
        Ok(())
    }

    #[test]
    fn members_cells_and_locations() {
        assert!(Cluster::MEMBERS.iter().all(|c| c.is_member()) && !HUB.is_member());
        assert!(Cluster::CELLS.iter().all(|c| c.is_cell()) && !EDGE_1.is_cell() && !HUB.is_cell());
        assert_eq!(CELL_A.location(), Some("dfw"));
        assert_eq!(CELL_B.location(), Some("sjc"));
        assert_eq!(EDGE_1.location(), None);
        let prefixes: std::collections::BTreeSet<_> = Cluster::ALL.iter().map(|c| c.etcd_prefix()).collect();
        assert_eq!(prefixes.len(), Cluster::ALL.len());
        let ranges: std::collections::BTreeSet<_> = Cluster::ALL.iter().map(|c| c.service_cidr()).collect();
        assert_eq!(ranges.len(), Cluster::ALL.len());
        assert_eq!(CELL_B.service_cidr(), "198.19.2.0/24");
        assert_eq!(CELL_B.kubernetes_service_ip().to_string(), "198.19.2.1");
    }

    #[test]
    fn serde_uses_the_names() -> anyhow::Result<()> {
        assert_eq!(serde_json::to_string(&CELL_A)?, "\"cell-a\"");
        Ok(())
    }
}
