//! Running the product binary, `replicator`, against the environment.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::cluster::Cluster;
use crate::controlplane::Environment;
use crate::error::{Error, Result, io_context};
use crate::metrics::{counter_value, metric_value};
use crate::paths;
use crate::process::log_tail;
use crate::wait::{self, Check};

/// How long a replicator gets to exit after SIGKILL.
const AFTER_KILL: Duration = Duration::from_secs(10);
/// The timeout of one HTTP request to the replicator.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How many log lines an error about the replicator quotes.
const LOG_TAIL_LINES: usize = 40;

/// Which credentials a spawned `replicator` gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credentials {
    /// Tokens of service accounts bound to exactly the roles rendered from `config/rbac/{cell,hub}`
    /// (see [`crate::rbac`]): on the hub, `replicator-<location>` for `replicator run` and
    /// `replicator-membership` for membership, which the hub's admission policies confine as
    /// they confine a deployment. The default.
    LeastPrivilege,
    /// The environment's admin kubeconfigs (`system:masters`), for a scenario that needs them on
    /// purpose; see [`ReplicatorSpec::admin`].
    Admin,
}

/// What to run: which cell, which location name, and any extra arguments or environment.
#[derive(Debug, Clone)]
pub struct ReplicatorSpec {
    cell: Cluster,
    location: String,
    binary: Option<PathBuf>,
    hub_kubeconfig: Option<PathBuf>,
    cell_kubeconfig: Option<PathBuf>,
    credentials: Credentials,
    membership: bool,
    cells: Vec<(Cluster, String)>,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    identity: Option<String>,
}

impl ReplicatorSpec {
    /// A replicator for `cell`, whose `--location` is the cell's name, running with the
    /// least-privilege identities ([`Credentials::LeastPrivilege`]).
    pub fn new(cell: Cluster) -> ReplicatorSpec {
        ReplicatorSpec {
            cell,
            location: cell.name().to_owned(),
            binary: None,
            hub_kubeconfig: None,
            cell_kubeconfig: None,
            credentials: Credentials::LeastPrivilege,
            membership: false,
            cells: Vec::new(),
            args: Vec::new(),
            envs: Vec::new(),
            identity: None,
        }
    }

    /// `replicator membership` against the hub instead of `replicator run` for a cell; its log
    /// and [`ReplicatorProcess::location`] are named `membership`.
    pub fn membership() -> ReplicatorSpec {
        ReplicatorSpec {
            membership: true,
            ..ReplicatorSpec::new(Cluster::Hub).location("membership")
        }
    }

    /// One `replicator run` serving several cells (`--cell LOCATION=KUBECONFIG` each, and with
    /// least privilege `--cell-hub-kubeconfig LOCATION=KUBECONFIG` of `replicator-<location>`
    /// each) instead of one; its log and [`ReplicatorProcess::location`] are the locations joined
    /// by `+`.
    pub fn cells(cells: &[(Cluster, &str)]) -> ReplicatorSpec {
        let joined = cells.iter().map(|(_, l)| *l).collect::<Vec<_>>().join("+");
        ReplicatorSpec {
            cells: cells.iter().map(|(c, l)| (*c, (*l).to_owned())).collect(),
            ..ReplicatorSpec::new(Cluster::Hub).location(joined)
        }
    }

    /// Overrides `--hub-kubeconfig` (default: the hub identity of the spec's [`Credentials`]:
    /// `replicator-<location>`). With [`ReplicatorSpec::cells`], every cell then uses it (no
    /// `--cell-hub-kubeconfig` is passed).
    #[must_use]
    pub fn hub_kubeconfig(mut self, path: impl Into<PathBuf>) -> ReplicatorSpec {
        self.hub_kubeconfig = Some(path.into());
        self
    }

    /// Overrides `--cell-kubeconfig` (default: the cell identity of the spec's [`Credentials`]),
    /// for example with one that reaches the cell through a [`crate::fault_proxy::FaultProxy`].
    #[must_use]
    pub fn cell_kubeconfig(mut self, path: impl Into<PathBuf>) -> ReplicatorSpec {
        self.cell_kubeconfig = Some(path.into());
        self
    }

    /// Runs with the environment's admin kubeconfigs instead of the least-privilege service
    /// accounts. Only for a scenario that needs admin on purpose (say, one about a kind the
    /// shipped roles rightly do not grant); every other scenario proves the shipped RBAC.
    #[must_use]
    pub fn admin(mut self) -> ReplicatorSpec {
        self.credentials = Credentials::Admin;
        self
    }

    /// The credentials the process will run with.
    pub fn credentials(&self) -> Credentials {
        self.credentials
    }

    /// Runs the process with `--identity <identity>`: a process spawned again with the
    /// identity of one that was killed is the same replica restarted (as a container restarted
    /// in its pod keeps `$POD_NAME`). Default: an identity no other process of this machine has
    /// ([`ReplicatorProcess::identity`] tells it).
    #[must_use]
    pub fn identity(mut self, identity: impl Into<String>) -> ReplicatorSpec {
        self.identity = Some(identity.into());
        self
    }

    /// Overrides `--location`.
    #[must_use]
    pub fn location(mut self, location: impl Into<String>) -> ReplicatorSpec {
        self.location = location.into();
        self
    }

    /// Runs this binary instead of [`ReplicatorProcess::binary_path`] (for example a fake).
    #[must_use]
    pub fn binary(mut self, path: impl Into<PathBuf>) -> ReplicatorSpec {
        self.binary = Some(path.into());
        self
    }

    /// Appends one extra argument after the standard ones.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> ReplicatorSpec {
        self.args.push(arg.into());
        self
    }

    /// Appends extra arguments after the standard ones.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> ReplicatorSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable for the process (for example `RUST_LOG`).
    #[must_use]
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> ReplicatorSpec {
        self.envs.push((key.into(), value.into()));
        self
    }
}

/// A running `replicator` process. Dropping it kills the process (SIGKILL).
#[derive(Debug)]
pub struct ReplicatorProcess {
    child: Child,
    pid: u32,
    location: String,
    identity: String,
    metrics_addr: SocketAddr,
    health_addr: SocketAddr,
    log: PathBuf,
    http: reqwest::Client,
}

impl ReplicatorProcess {
    /// The binary that is run: `$REPLICATOR_BIN`, else `<target dir>/debug/replicator`.
    pub fn binary_path() -> PathBuf {
        paths::non_empty_var("REPLICATOR_BIN")
            .map(|bin| paths::absolute(PathBuf::from(bin)))
            .unwrap_or_else(|| paths::target_dir().join("debug").join("replicator"))
    }

    /// Starts `replicator run --location <loc> --cell-kubeconfig <cell> --hub-kubeconfig <hub>
    /// --metrics-bind-address 127.0.0.1:<free> --health-probe-bind-address 127.0.0.1:<free>
    /// [extra args]` (or `replicator membership --hub-kubeconfig <hub> ...`), logging to
    /// `logs/replicator-<location>-<n>.log`. The kubeconfigs are the least-privilege identities
    /// of [`Environment::least_privilege`] (created on first use) unless the spec says
    /// otherwise: in the cell, the cell's; on the hub, `replicator-<location>` of
    /// [`crate::rbac::Identities::hub_kubeconfig_for`] (with [`ReplicatorSpec::cells`], one
    /// `--cell-hub-kubeconfig LOCATION=...` per cell, and the first cell's as
    /// `--hub-kubeconfig`), or `replicator-membership` for membership.
    pub async fn spawn(env: &Environment, spec: ReplicatorSpec) -> Result<ReplicatorProcess> {
        let binary = spec.binary.clone().unwrap_or_else(ReplicatorProcess::binary_path);
        if !binary.is_file() {
            return Err(Error::ReplicatorBinaryMissing(binary));
        }
        let metrics_addr = free_loopback_addr()?;
        let health_addr = free_loopback_addr()?;
        let identities = match spec.credentials {
            Credentials::LeastPrivilege => Some(env.least_privilege().await?),
            Credentials::Admin => None,
        };
        let hub_kubeconfig = match (&spec.hub_kubeconfig, &identities) {
            (Some(path), _) => path.clone(),
            (None, Some(ids)) if spec.membership => ids.membership_kubeconfig(),
            // Several cells: `--hub-kubeconfig` is the first cell's identity (each cell also
            // gets its own `--cell-hub-kubeconfig` below).
            (None, Some(ids)) => match spec.cells.first() {
                Some((_, location)) => ids.hub_kubeconfig_for(env, location).await?,
                None => ids.hub_kubeconfig_for(env, &spec.location).await?,
            },
            (None, None) => env.kubeconfig_path(Cluster::Hub),
        };
        let cell_kubeconfig = match (&spec.cell_kubeconfig, &identities) {
            (Some(path), _) => path.clone(),
            (None, Some(ids)) if !spec.membership && spec.cells.is_empty() => ids.cell_kubeconfig(spec.cell)?,
            (None, _) => env.kubeconfig_path(spec.cell),
        };
        let mut args: Vec<OsString> = if spec.membership {
            vec!["membership".into()]
        } else if !spec.cells.is_empty() {
            let mut args: Vec<OsString> = vec!["run".into()];
            for (cell, location) in &spec.cells {
                args.push("--cell".into());
                let mut value = OsString::from(format!("{location}="));
                value.push(match &identities {
                    Some(ids) => ids.cell_kubeconfig(*cell)?,
                    None => env.kubeconfig_path(*cell),
                });
                args.push(value);
            }
            // Each cell writes to the hub as its location's identity, unless the scenario named
            // one hub kubeconfig for all.
            if let (Some(ids), None) = (&identities, &spec.hub_kubeconfig) {
                for (_, location) in &spec.cells {
                    args.push("--cell-hub-kubeconfig".into());
                    let mut value = OsString::from(format!("{location}="));
                    value.push(ids.hub_kubeconfig_for(env, location).await?);
                    args.push(value);
                }
            }
            args
        } else {
            vec![
                "run".into(),
                "--location".into(),
                spec.location.clone().into(),
                "--cell-kubeconfig".into(),
                cell_kubeconfig.into(),
            ]
        };
        args.extend([
            "--hub-kubeconfig".into(),
            hub_kubeconfig.into(),
            "--metrics-bind-address".into(),
            metrics_addr.to_string().into(),
            "--health-probe-bind-address".into(),
            health_addr.to_string().into(),
        ]);
        let identity = spec.identity.clone().unwrap_or_else(|| {
            static SPAWNED: AtomicU32 = AtomicU32::new(0);
            format!(
                "e2e-{}-{}-{}",
                spec.location,
                std::process::id(),
                SPAWNED.fetch_add(1, Ordering::Relaxed)
            )
        });
        // Every process is its own replica unless the scenario says it restarts one: the
        // product's default identity (the host name) is shared by every process here.
        args.extend(["--identity".into(), identity.clone().into()]);
        // The rendered Lease Roles live in the identities' namespace, so the Leases do too;
        // an admin process uses `default`, which no scenario removes.
        let namespace = if identities.is_some() {
            crate::rbac::NAMESPACE
        } else {
            "default"
        };
        args.extend(["--lease-namespace".into(), namespace.into()]);
        let elects = spec.args.iter().any(|a| {
            let a = a.to_string_lossy();
            a.starts_with("--lease-name") || a.starts_with("--leader-elect")
        });
        if spec.membership && !elects {
            // Membership elects on one Lease for the whole hub, and scenarios of other test
            // processes run their own membership beside this one: a process writes on its own
            // (and leaves no Lease behind) unless the scenario groups its replicas under a
            // `--lease-name` (and removes that Lease when it ends).
            args.push("--leader-elect=false".into());
        }
        args.extend(spec.args.iter().cloned());
        let (log, mut out) = create_log(&env.logs_dir(), &spec.location)?;
        writeln!(
            out,
            "=== replicator-e2e: {} {}",
            binary.display(),
            args.iter()
                .map(|arg| arg.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        )
        .map_err(io_context(format!("writing {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io_context(format!("duplicating the handle of {}", log.display())))?;
        let child = Command::new(&binary)
            .args(&args)
            .envs(spec.envs.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(io_context(format!("starting {}", binary.display())))?;
        let pid = child
            .id()
            .ok_or_else(|| Error::Config("the replicator exited before its pid was read".into()))?;
        let http = reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build()?;
        tracing::info!(pid, location = spec.location, log = %log.display(), "started replicator");
        Ok(ReplicatorProcess {
            child,
            pid,
            location: spec.location,
            identity,
            metrics_addr,
            health_addr,
            log,
            http,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The `--identity` it runs with.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The `--location` it runs with.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }

    /// `http://127.0.0.1:<port>/metrics`.
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.metrics_addr)
    }

    /// `http://127.0.0.1:<port>` of the health-probe server (`/readyz`, `/healthz`).
    pub fn health_url(&self) -> String {
        format!("http://{}", self.health_addr)
    }

    /// GETs `/metrics` and returns the exposition text.
    pub async fn scrape_metrics(&self) -> Result<String> {
        let response = self.http.get(self.metrics_url()).send().await?;
        Ok(response.error_for_status()?.text().await?)
    }

    /// Scrapes `/metrics` and returns one value (see [`metric_value`]).
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<Option<f64>> {
        Ok(metric_value(&self.scrape_metrics().await?, name, labels))
    }

    /// Scrapes `/metrics` and returns counter `name` for `labels` (see [`counter_value`]): zero
    /// before its first increment.
    ///
    /// # Errors
    /// [`Error::Scenario`] when the exposition does not declare the counter (a renamed or
    /// misspelt metric fails instead of reading as zero); scrape errors.
    pub async fn counter(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        counter_value(&self.scrape_metrics().await?, name, labels)
            .ok_or_else(|| Error::Scenario(format!("replicator {} declares no counter {name}", self.location())))
    }

    /// Whether the process has exited (and how), without waiting.
    pub fn try_exit_status(&mut self) -> Result<Option<ExitStatus>> {
        self.child
            .try_wait()
            .map_err(io_context(format!("checking replicator pid {}", self.pid)))
    }

    /// Polls `/readyz` on the health port until it answers 200. Fails early, with the log tail,
    /// if the process exits.
    pub async fn wait_ready(&mut self, deadline: Duration) -> Result<()> {
        let url = format!("{}/readyz", self.health_url());
        let what = format!("replicator {} (pid {}) to answer {url}", self.location, self.pid);
        let http = self.http.clone();
        let child = &mut self.child;
        let result = wait::until_observed(deadline, &what, || {
            let exited = child.try_wait();
            let request = http.get(&url).send();
            async move {
                match exited {
                    Ok(Some(status)) => {
                        return Ok(Check::Abort(format!("it exited with {status}")));
                    }
                    Ok(None) => {}
                    Err(error) => return Err(io_context("checking the replicator")(error)),
                }
                let response = request.await?;
                let status = response.status();
                Ok(if status == reqwest::StatusCode::OK {
                    Check::Ready(())
                } else {
                    let body = response.text().await.unwrap_or_default();
                    Check::NotYet(format!("HTTP {status}: {}", body.trim()))
                })
            }
        })
        .await;
        result.map_err(|reason| Error::NotReady {
            component: format!("replicator {}", self.location),
            reason: Box::new(reason),
            log: self.log.clone(),
            log_tail: log_tail(&self.log, LOG_TAIL_LINES),
        })
    }

    /// SIGKILLs the process and waits for it to exit.
    pub async fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_exit_status()? {
            return Ok(status);
        }
        self.child
            .start_kill()
            .map_err(io_context(format!("killing replicator pid {}", self.pid)))?;
        self.wait_exit(AFTER_KILL).await
    }

    /// SIGTERMs the process and waits up to `grace` for it to exit; SIGKILLs it after that.
    pub async fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_exit_status()? {
            return Ok(status);
        }
        let pid = i32::try_from(self.pid)
            .map(Pid::from_raw)
            .map_err(|_| Error::Config(format!("pid {} out of range", self.pid)))?;
        match kill(pid, Signal::SIGTERM) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(source) => {
                return Err(Error::Signal {
                    pid: self.pid,
                    signal: Signal::SIGTERM,
                    source,
                });
            }
        }
        match self.wait_exit(grace).await {
            Ok(status) => Ok(status),
            Err(Error::Timeout { .. }) => {
                tracing::warn!(pid = self.pid, ?grace, "replicator ignored SIGTERM; killing it");
                self.kill().await
            }
            Err(error) => Err(error),
        }
    }

    async fn wait_exit(&mut self, deadline: Duration) -> Result<ExitStatus> {
        match tokio::time::timeout(deadline, self.child.wait()).await {
            Ok(status) => status.map_err(io_context(format!("waiting for replicator pid {}", self.pid))),
            Err(_elapsed) => Err(Error::Timeout {
                what: format!("replicator pid {} to exit", self.pid),
                waited: deadline,
                last: "still running".to_owned(),
            }),
        }
    }
}

impl Drop for ReplicatorProcess {
    fn drop(&mut self) {
        // `kill_on_drop` also does this; being explicit keeps the guarantee visible. An error
        // here means the process is already gone.
        let _ = self.child.start_kill();
    }
}

/// A plain HTTP GET (no proxy, 5 s timeout), for probing a replicator's endpoints in ways
/// [`ReplicatorProcess`] does not cover (for example expecting a 503). Returns the status code
/// and the body.
pub async fn http_get(url: &str) -> Result<(u16, String)> {
    let client = reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build()?;
    let response = client.get(url).send().await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

/// A loopback address with a port that was free a moment ago.
fn free_loopback_addr() -> Result<SocketAddr> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io_context("reserving a free loopback port"))?;
    listener
        .local_addr()
        .map_err(io_context("reading a reserved loopback port"))
}

/// Creates `logs/replicator-<location>-<n>.log` with the first free `n`.
fn create_log(dir: &Path, location: &str) -> Result<(PathBuf, std::fs::File)> {
    std::fs::create_dir_all(dir).map_err(io_context(format!("creating {}", dir.display())))?;
    let safe: String = location
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    for n in 0..u32::MAX {
        let path = dir.join(format!("replicator-{safe}-{n}.log"));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(io_context(format!("creating {}", path.display()))(error)),
        }
    }
    Err(Error::Config(format!(
        "no free log file name for replicator {location}"
    )))
}
