//! The three clusters of the environment.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// One of the environment's kube-apiservers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cluster {
    /// The hub, where the replicator mirrors objects to (also runs kube-controller-manager).
    Hub,
    /// The first cell.
    CellA,
    /// The second cell.
    CellB,
}

/// The hub cluster.
pub const HUB: Cluster = Cluster::Hub;
/// The first cell cluster.
pub const CELL_A: Cluster = Cluster::CellA;
/// The second cell cluster.
pub const CELL_B: Cluster = Cluster::CellB;

impl Cluster {
    /// All clusters, hub first.
    pub const ALL: [Cluster; 3] = [Cluster::Hub, Cluster::CellA, Cluster::CellB];

    /// The cluster's name: `hub`, `cell-a` or `cell-b`.
    pub fn name(self) -> &'static str {
        match self {
            Cluster::Hub => "hub",
            Cluster::CellA => "cell-a",
            Cluster::CellB => "cell-b",
        }
    }

    /// The etcd key prefix this cluster's apiserver stores under (`/hub`, `/cell-a`, `/cell-b`).
    pub fn etcd_prefix(self) -> &'static str {
        match self {
            Cluster::Hub => "/hub",
            Cluster::CellA => "/cell-a",
            Cluster::CellB => "/cell-b",
        }
    }

    /// Whether this is one of the cells (not the hub).
    pub fn is_cell(self) -> bool {
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
    fn serde_uses_the_names() -> anyhow::Result<()> {
        assert_eq!(serde_json::to_string(&CELL_A)?, "\"cell-a\"");
        Ok(())
    }
}
