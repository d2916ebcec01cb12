//! The harness's error type.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Result alias used throughout the harness.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while running the local control plane or the product binary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem or process-spawning operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// An external command ran but exited unsuccessfully.
    #[error("`{command}` exited with {status}:\n{output}")]
    CommandFailed {
        /// The command line, for humans.
        command: String,
        /// Its exit status.
        status: ExitStatus,
        /// Its captured stderr (and stdout), or a pointer to where the output went.
        output: String,
    },

    /// A polled condition did not hold before its deadline.
    #[error("timed out after {waited:?} waiting for {what}; last observation: {last}")]
    Timeout {
        /// The condition that was awaited.
        what: String,
        /// How long the harness waited.
        waited: Duration,
        /// The last thing the poll saw.
        last: String,
    },

    /// A poll gave up early because the condition can no longer become true.
    #[error("gave up waiting for {what}: {reason}")]
    Aborted {
        /// The condition that was awaited.
        what: String,
        /// Why waiting any longer is pointless (for example: the process exited).
        reason: String,
    },

    /// A component of the environment did not become ready; carries the tail of its log.
    /// (The reason is part of the message rather than a `source()`, so that printing this error
    /// alone tells the whole story.)
    #[error("{component} did not become ready: {reason}\n--- last lines of {} ---\n{log_tail}", log.display())]
    NotReady {
        /// The component name, for example `kube-apiserver hub`.
        component: String,
        /// Why it is considered not ready (usually [`Error::Timeout`] or [`Error::Aborted`]).
        reason: Box<Error>,
        /// Its log file.
        log: PathBuf,
        /// The last lines of that log file.
        log_tail: String,
    },

    /// A control-plane binary is still missing after running the build script.
    #[error("control-plane binary {} is missing after running {}", path.display(), script.display())]
    BinaryMissing {
        /// The binary that is missing.
        path: PathBuf,
        /// The build script that should have produced it.
        script: PathBuf,
    },

    /// The product binary has not been built.
    #[error(
        "replicator binary not found at {}; run `cargo build -p replicator` first (or set REPLICATOR_BIN)",
        .0.display()
    )]
    ReplicatorBinaryMissing(PathBuf),

    /// A port the environment needs is held by a process this harness did not start.
    #[error("port {port} needed by {component} is already in use by a process this harness did not start")]
    PortInUse {
        /// The port.
        port: u16,
        /// The component that needs it.
        component: String,
    },

    /// No environment is recorded in the state directory.
    #[error("no environment is recorded in {}; run `replicator-env up`", .0.display())]
    NotUp(PathBuf),

    /// The state file could not be parsed or serialised.
    #[error("state file {}: {source}", path.display())]
    State {
        /// The state file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },

    /// A configuration value (environment variable, argument) is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A scenario's fixture or expectation does not hold (used by scenario helpers).
    #[error("{0}")]
    Scenario(String),

    /// The name does not denote one of the environment's clusters.
    #[error("unknown cluster {0:?}; expected one of hub, cell-a, cell-b, edge-1")]
    UnknownCluster(String),

    /// Sending a signal failed for a reason other than the process being gone.
    #[error("sending {signal} to pid {pid}: {source}")]
    Signal {
        /// The target process.
        pid: u32,
        /// The signal.
        signal: nix::sys::signal::Signal,
        /// The underlying error.
        #[source]
        source: nix::Error,
    },

    /// Taking the state directory lock failed.
    #[error("locking {}: {source}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::Error,
    },

    /// A Kubernetes API call failed.
    #[error(transparent)]
    Kube(#[from] kube::Error),

    /// A kubeconfig could not be loaded.
    #[error(transparent)]
    Kubeconfig(#[from] kube::config::KubeconfigError),

    /// An HTTP request (health probe, metrics scrape) failed.
    #[error("HTTP request failed: {0}")]
    Http(#[from] reqwest::Error),
}

/// Builds a closure that wraps an [`std::io::Error`] with a description of what was being done.
pub(crate) fn io_context(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
