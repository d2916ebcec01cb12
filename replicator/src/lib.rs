//! replicator: mirrors network objects from Kubernetes cells onto a Karmada hub.
//!
//! Pure transforms ([`copy`], [`routing`], [`rules`]) are free of I/O; [`sync`] and [`sweep`]
//! are the Kubernetes I/O around them; [`cluster`] owns the clients; [`cli`] wires it all.
#![deny(missing_docs)]

pub mod api;
pub mod api_errors;
pub mod cache;
pub mod cli;
pub mod cluster;
pub mod copy;
pub mod echo;
pub mod election;
pub mod health;
pub mod http;
pub mod kubeconfig_watch;
pub mod logging;
pub mod membership;
pub mod metrics;
pub mod outage;
pub mod policies;
pub mod process_metrics;
pub mod queue;
pub mod routing;
pub mod rules;
pub mod runtime;
pub mod status;
pub mod sweep;
pub mod sync;
