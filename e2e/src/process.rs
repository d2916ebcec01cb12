//! Detached control-plane processes: spawning them into their own process group with output to a
//! log file, recognising them again later by pid and start time, and stopping them.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, getpgid};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, io_context};
use crate::wait;

/// How long a process gets to exit after SIGKILL before the harness reports it as stuck.
const AFTER_KILL: Duration = Duration::from_secs(10);

/// Children spawned by this process, kept so they are reaped (not left as zombies that would
/// still look alive) when they exit while this process runs.
static CHILDREN: Mutex<Vec<Child>> = Mutex::new(Vec::new());

/// A process the harness started, as recorded in `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// Its pid (also its process group id).
    pub pid: u32,
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat` field 22), which tells it
    /// apart from a later process that reuses the pid.
    pub start_time: u64,
    /// The file its stdout and stderr go to.
    pub log: PathBuf,
}

impl ProcessRecord {
    /// Whether this very process is still running (not exited, not a zombie, pid not reused).
    pub fn is_alive(&self) -> bool {
        reap_children();
        proc_stat(self.pid).is_some_and(|stat| stat.alive && stat.start_time == self.start_time)
    }

    /// Sends `signal` to the process (SIGKILL goes to its whole process group if it leads one).
    /// A process that is already gone is not an error.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        if !self.is_alive() {
            return Ok(());
        }
        let pid = raw_pid(self.pid)?;
        let leads_its_group = getpgid(Some(pid)).is_ok_and(|group| group == pid);
        let sent = if signal == Signal::SIGKILL && leads_its_group {
            killpg(pid, signal)
        } else {
            kill(pid, signal)
        };
        match sent {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(source) => Err(Error::Signal {
                pid: self.pid,
                signal,
                source,
            }),
        }
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit, then SIGKILLs its process
    /// group and waits for it to be gone.
    pub async fn terminate(&self, name: &str, grace: Duration) -> Result<()> {
        if !self.is_alive() {
            return Ok(());
        }
        tracing::debug!(pid = self.pid, name, "sending SIGTERM");
        self.signal(Signal::SIGTERM)?;
        let what = format!("{name} (pid {}) to exit after SIGTERM", self.pid);
        if self.wait_gone(&what, grace).await.is_ok() {
            return Ok(());
        }
        tracing::warn!(
            pid = self.pid,
            name,
            ?grace,
            "did not exit after SIGTERM; sending SIGKILL"
        );
        self.kill_and_wait(name).await
    }

    /// SIGKILLs the process group and waits for the process to be gone.
    pub async fn kill_and_wait(&self, name: &str) -> Result<()> {
        self.signal(Signal::SIGKILL)?;
        let what = format!("{name} (pid {}) to exit after SIGKILL", self.pid);
        self.wait_gone(&what, AFTER_KILL).await
    }

    /// Whether `/proc` still lists this process, running or as a zombie not yet reaped.
    fn is_listed(&self) -> bool {
        reap_children();
        proc_stat(self.pid).is_some_and(|stat| stat.start_time == self.start_time)
    }

    async fn wait_gone(&self, what: &str, deadline: Duration) -> Result<()> {
        wait::until(deadline, what, || {
            let gone = !self.is_alive();
            async move { Ok::<_, Error>(gone.then_some(())) }
        })
        .await
    }
}

/// Starts `program` detached from the caller: its own process group (so a Ctrl-C in the
/// terminal that ran `replicator-env up` does not reach it), stdin from /dev/null, stdout and
/// stderr appended to `log`.
pub(crate) fn spawn_detached(program: &Path, args: &[OsString], log: &Path) -> Result<ProcessRecord> {
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(io_context(format!("creating {}", dir.display())))?;
    }
    let mut out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io_context(format!("opening {}", log.display())))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    writeln!(
        out,
        "=== replicator-e2e: starting at unix time {now}: {} {}",
        program.display(),
        args.iter()
            .map(|arg| arg.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    )
    .map_err(io_context(format!("writing {}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(io_context(format!("duplicating the handle of {}", log.display())))?;
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(io_context(format!("starting {}", program.display())))?;
    let pid = child.id();
    CHILDREN.lock().unwrap_or_else(PoisonError::into_inner).push(child);
    // The child is ours and unreaped, so its /proc entry exists even if it already exited.
    let start_time = proc_stat(pid).map_or(0, |stat| stat.start_time);
    Ok(ProcessRecord {
        pid,
        start_time,
        log: log.to_path_buf(),
    })
}

/// Waits (up to `deadline`) until stopped processes have been reaped, so that they no longer
/// show up in `ps` as zombies. Processes started by an earlier command were re-parented to init,
/// which reaps them on its own schedule; giving up is not an error.
pub(crate) async fn wait_reaped(records: &[ProcessRecord], deadline: Duration) {
    let result = wait::until(deadline, "stopped processes to be reaped", || {
        let listed: Vec<u32> = records
            .iter()
            .filter(|record| record.is_listed())
            .map(|record| record.pid)
            .collect();
        async move {
            if listed.is_empty() {
                Ok(Some(()))
            } else {
                Err(format!("pids {listed:?} are still listed"))
            }
        }
    })
    .await;
    if let Err(error) = result {
        tracing::debug!(%error, "zombies remain; init will reap them");
    }
}

/// Kills every process whose executable is named one of `executables` and whose command line
/// mentions a path inside `dir`: leftovers of earlier environments in the same state directory,
/// whatever their state file says. Returns them.
pub(crate) async fn sweep(dir: &Path, executables: &[&str]) -> Result<Vec<ProcessRecord>> {
    let found = find(dir, executables)?;
    for (record, _) in &found {
        tracing::info!(pid = record.pid, "killing a leftover process of this environment");
        record.kill_and_wait("leftover process").await?;
    }
    Ok(found.into_iter().map(|(record, _)| record).collect())
}

/// The running processes whose executable is named one of `executables` and whose command line
/// mentions a path inside `dir`, with their executable's name.
pub(crate) fn find(dir: &Path, executables: &[&str]) -> Result<Vec<(ProcessRecord, String)>> {
    let needle = format!("{}/", dir.display());
    let own = std::process::id();
    let entries = std::fs::read_dir("/proc").map_err(io_context("listing /proc to find leftovers"))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(exe) = std::fs::read_link(entry.path().join("exe")) else {
            continue;
        };
        let exe_name = exe
            .file_name()
            .map(|name| name.to_string_lossy().trim_end_matches(" (deleted)").to_owned())
            .unwrap_or_default();
        if !executables.contains(&exe_name.as_str()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if !String::from_utf8_lossy(&cmdline).contains(&needle) {
            continue;
        }
        let Some(stat) = proc_stat(pid).filter(|stat| stat.alive) else {
            continue;
        };
        found.push((
            ProcessRecord {
                pid,
                start_time: stat.start_time,
                log: PathBuf::new(),
            },
            exe_name,
        ));
    }
    Ok(found)
}

/// The last `lines` lines of a log file (at most the last 64 KiB of it).
pub fn log_tail(path: &Path, lines: usize) -> String {
    const WINDOW: u64 = 64 * 1024;
    let read = || -> std::io::Result<String> {
        let mut file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(error) => format!("(could not read {}: {error})", path.display()),
    }
}

struct ProcStat {
    alive: bool,
    start_time: u64,
}

/// Parses `/proc/<pid>/stat`; `None` if there is no such process.
fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is parenthesised and may contain spaces: split after it.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); the start time is field 22.
    let state = fields.first()?;
    let start_time = fields.get(19)?.parse().ok()?;
    Some(ProcStat {
        alive: !matches!(*state, "Z" | "X" | "x"),
        start_time,
    })
}

/// Reaps any child of this process that has exited.
fn reap_children() {
    let mut children = CHILDREN.lock().unwrap_or_else(PoisonError::into_inner);
    children.retain_mut(|child| matches!(child.try_wait(), Ok(None)));
}

fn raw_pid(pid: u32) -> Result<Pid> {
    i32::try_from(pid)
        .map(Pid::from_raw)
        .map_err(|_| Error::Config(format!("pid {pid} out of range")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_stat_parses() {
        let stat = proc_stat(std::process::id());
        assert!(stat.as_ref().is_some_and(|s| s.alive && s.start_time > 0));
    }

    #[tokio::test]
    async fn spawned_process_is_tracked_and_terminated() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("replicator-e2e-process-{}", std::process::id()));
        let log = dir.join("sleep.log");
        let record = spawn_detached(Path::new("/bin/sleep"), &["600".into()], &log)?;
        assert!(record.is_alive());
        record.terminate("sleep", Duration::from_secs(5)).await?;
        assert!(!record.is_alive());
        let reused = ProcessRecord {
            start_time: record.start_time + 1,
            ..record.clone()
        };
        assert!(!reused.is_alive());
        assert!(log_tail(&log, 5).contains("starting at unix time"));
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
