//! The end-to-end harness: a local, real control plane built from pinned upstream sources (one
//! etcd, four kube-apiservers named `hub`, `cell-a`, `cell-b` and `edge-1`; on the hub a real
//! Karmada: kube-controller-manager, karmada-aggregated-apiserver, -webhook, -controller-manager
//! and -scheduler, with the other three clusters registered as push-mode members), plus helpers
//! to run the `replicator` binary against it and to wait for what Karmada carries to members.
//!
//! ```no_run
//! # async fn example() -> Result<(), replicator_e2e::Error> {
//! use replicator_e2e::{CELL_A, Environment, ReplicatorProcess, ReplicatorSpec};
//!
//! let env = Environment::ensure_up().await?;
//! let cell = env.client(CELL_A).await?;
//! let mut replicator = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_A)).await?;
//! replicator.wait_ready(std::time::Duration::from_secs(30)).await?;
//! # drop(cell);
//! # Ok(())
//! # }
//! ```

pub mod audit;
pub mod bench;
pub mod binaries;
pub mod cluster;
mod command;
pub mod controlplane;
pub mod convergence;
mod crds;
pub mod daemon;
pub mod deploy;
pub mod error;
mod etcd;
pub mod fault_proxy;
mod files;
pub mod fixtures;
pub mod hostnet;
pub mod images;
pub mod karmada;
pub mod kubeconfig;
pub mod metrics;
pub mod node;
pub mod paths;
pub mod pki;
pub mod ports;
pub mod process;
pub mod propagation;
pub mod rbac;
pub mod replicator_process;
mod state;
pub mod wait;

pub use cluster::{CELL_A, CELL_B, Cluster, EDGE_1, HUB};
pub use controlplane::{ComponentStatus, Environment, MemberStatus, Status};
pub use daemon::Daemon;
pub use error::{Error, Result};
pub use metrics::metric_value;
pub use replicator_process::{Credentials, ReplicatorProcess, ReplicatorSpec};
