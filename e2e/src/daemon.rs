//! The long-running control-plane processes besides etcd and the apiservers: the hub's
//! kube-controller-manager and the four Karmada components.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ports::Ports;

/// A control-plane process that is not etcd or an apiserver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Daemon {
    /// kube-controller-manager against the hub (namespace and garbage-collector controllers).
    KubeControllerManager,
    /// karmada-aggregated-apiserver: serves `cluster.karmada.io` through the hub.
    KarmadaAggregatedApiserver,
    /// karmada-webhook: the mutating and validating webhooks of the Karmada APIs.
    KarmadaWebhook,
    /// karmada-controller-manager (detector, cluster, binding, execution, ... controllers).
    KarmadaControllerManager,
    /// karmada-scheduler.
    KarmadaScheduler,
}

impl Daemon {
    /// Every daemon, in start order.
    pub const ALL: [Daemon; 5] = [
        Daemon::KarmadaAggregatedApiserver,
        Daemon::KarmadaWebhook,
        Daemon::KubeControllerManager,
        Daemon::KarmadaControllerManager,
        Daemon::KarmadaScheduler,
    ];

    /// The daemon's name, which is also its executable's name and its log file's stem.
    pub fn name(self) -> &'static str {
        match self {
            Daemon::KubeControllerManager => "kube-controller-manager",
            Daemon::KarmadaAggregatedApiserver => "karmada-aggregated-apiserver",
            Daemon::KarmadaWebhook => "karmada-webhook",
            Daemon::KarmadaControllerManager => "karmada-controller-manager",
            Daemon::KarmadaScheduler => "karmada-scheduler",
        }
    }

    /// The URL the harness probes to tell whether the daemon is ready (see [`Daemon::probe`]).
    /// The aggregated apiserver's is its own `/readyz` (which admits anonymous requests).
    /// karmada-webhook registers no health checks (its health port answers 404 to `/readyz`
    /// and `/healthz`), so its TLS port is probed: any answer there means it serves, with a
    /// certificate the environment's CA verifies.
    pub fn health_url(self, ports: &Ports) -> String {
        match self {
            Daemon::KubeControllerManager => format!("https://127.0.0.1:{}/healthz", ports.controller_manager),
            Daemon::KarmadaAggregatedApiserver => {
                format!("https://127.0.0.1:{}/readyz", ports.karmada_aggregated_apiserver)
            }
            Daemon::KarmadaWebhook => format!("https://127.0.0.1:{}/", ports.karmada_webhook),
            Daemon::KarmadaControllerManager => {
                format!("http://127.0.0.1:{}/healthz", ports.karmada_controller_manager_health)
            }
            Daemon::KarmadaScheduler => format!("http://127.0.0.1:{}/healthz", ports.karmada_scheduler_health),
        }
    }
}

impl Daemon {
    /// How an answer from [`Daemon::health_url`] is judged.
    pub(crate) fn probe(self) -> Probe {
        match self {
            Daemon::KarmadaWebhook => Probe::AnyAnswer,
            _ => Probe::Ok200,
        }
    }
}

/// How the harness judges the answer to a health probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// HTTP 200, without credentials.
    Ok200,
    /// HTTP 200, with the admin bearer token (apiservers).
    Ok200WithToken,
    /// Any HTTP answer: the server accepts connections (and the TLS handshake succeeds).
    AnyAnswer,
    /// A containerd: `ctr version` answers on the socket the URL names (`unix://<path>`).
    ContainerdSocket,
}

impl fmt::Display for Daemon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_executables_and_serde_keys() -> anyhow::Result<()> {
        assert_eq!(
            serde_json::to_string(&Daemon::KarmadaAggregatedApiserver)?,
            "\"karmada-aggregated-apiserver\""
        );
        for daemon in Daemon::ALL {
            assert_eq!(serde_json::to_string(&daemon)?, format!("\"{}\"", daemon.name()));
        }
        Ok(())
    }
}
