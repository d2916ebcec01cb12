//! The machine and processes: what the report's header says, and resident memory from `/proc`.

use std::path::Path;

/// The machine the benchmark ran on.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub cores: usize,
    /// The CPU model (`/proc/cpuinfo`), or `unknown`.
    pub cpu: String,
    /// Total memory in bytes (`/proc/meminfo`), 0 when unknown.
    pub memory_bytes: u64,
    /// The kernel release (`/proc/sys/kernel/osrelease`), or `unknown`.
    pub kernel: String,
    /// The 1-minute load average when the run started (`/proc/loadavg`), `None` when unknown.
    pub load_at_start: Option<f64>,
}

impl Machine {
    /// Reads the machine's description.
    pub fn read() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| kib_field(&m, "MemTotal:"))
            .unwrap_or_default();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|k| k.trim().to_owned())
            .unwrap_or_else(|_| "unknown".to_owned());
        Machine {
            cores: std::thread::available_parallelism().map(usize::from).unwrap_or(1),
            cpu,
            memory_bytes,
            kernel,
            load_at_start: load_average(),
        }
    }
}

/// The 1-minute load average, `None` when `/proc/loadavg` cannot be read.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A `<key> <n> kB` line of a `/proc` status file, in bytes.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// Resident memory of a process, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rss {
    /// Now (`VmRSS`).
    pub current: u64,
    /// The peak since the process started (`VmHWM`).
    pub peak: u64,
}

/// The resident memory of process `pid`; `None` when it is gone.
pub fn rss(pid: u32) -> Option<Rss> {
    let status = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("status")).ok()?;
    Some(Rss {
        current: kib_field(&status, "VmRSS:")?,
        peak: kib_field(&status, "VmHWM:")?,
    })
}

/// CPU time process `pid` has used so far (user + system, from `/proc/<pid>/stat`); `None` when
/// it is gone.
pub fn cpu_time(pid: u32) -> Option<std::time::Duration> {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(std::time::Duration::from_millis(ticks * 10))
}

/// `git rev-parse --short HEAD` of the workspace, with `-dirty` when the tree has changes;
/// `unknown` when git is unavailable.
pub fn git_revision() -> String {
    let root = crate::paths::workspace_root();
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match run(&["rev-parse", "--short", "HEAD"]) {
        Some(rev) => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{rev}-dirty") } else { rev }
        }
        None => "unknown".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_fields_and_this_process() {
        assert_eq!(
            kib_field("VmHWM:\t  2048 kB\nVmRSS: 1024 kB\n", "VmRSS:"),
            Some(1024 * 1024)
        );
        let me = rss(std::process::id()).unwrap();
        assert!(me.peak >= me.current && me.current > 0, "{me:?}");
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(spin.elapsed());
        }
        assert!(cpu_time(std::process::id()).unwrap() > std::time::Duration::ZERO);
        assert!(Machine::read().cores >= 1);
    }
}
