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

/// The machine's CPU time so far, all cores, from the first line of `/proc/stat`, in ticks
/// (USER_HZ): what every process used, what stayed idle, and what the hypervisor gave to other
/// guests (`steal`). `None` when `/proc/stat` cannot be read.
pub fn machine_cpu() -> Option<MachineCpu> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let field = |i: usize| v.get(i).copied().unwrap_or(0);
    Some(MachineCpu {
        busy: field(0) + field(1) + field(2) + field(5) + field(6),
        idle: field(3) + field(4),
        steal: field(7),
    })
}

/// Machine CPU ticks (see [`machine_cpu`]); subtract two readings for a span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineCpu {
    /// Ticks spent running anything (user, nice, system, irq, softirq).
    pub busy: u64,
    /// Ticks idle or waiting for I/O.
    pub idle: u64,
    /// Ticks the hypervisor ran other guests while this one wanted to run.
    pub steal: u64,
}

impl MachineCpu {
    /// The ticks between `earlier` and `self`.
    pub fn since(self, earlier: MachineCpu) -> MachineCpu {
        MachineCpu {
            busy: self.busy.saturating_sub(earlier.busy),
            idle: self.idle.saturating_sub(earlier.idle),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }

    /// Busy and stolen shares of the span, percent of all the machine's CPU time: (busy, steal).
    /// `None` for an empty span.
    pub fn shares(self) -> Option<(f64, f64)> {
        let total = (self.busy + self.idle + self.steal) as f64;
        (total > 0.0).then(|| (self.busy as f64 * 100.0 / total, self.steal as f64 * 100.0 / total))
    }
}

/// Two spans together (pooled windows).
impl std::ops::Add for MachineCpu {
    type Output = MachineCpu;

    fn add(self, other: MachineCpu) -> MachineCpu {
        MachineCpu {
            busy: self.busy + other.busy,
            idle: self.idle + other.idle,
            steal: self.steal + other.steal,
        }
    }
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
    fn machine_cpu_shares_of_a_span() {
        let before = MachineCpu {
            busy: 1000,
            idle: 500,
            steal: 10,
        };
        let after = MachineCpu {
            busy: 1180,
            idle: 510,
            steal: 20,
        };
        let span = after.since(before);
        assert_eq!(
            span,
            MachineCpu {
                busy: 180,
                idle: 10,
                steal: 10
            }
        );
        assert_eq!(span.shares(), Some((90.0, 5.0)));
        assert_eq!((span + span).shares(), Some((90.0, 5.0)));
        assert_eq!(MachineCpu::default().shares(), None);
        // This machine's own counters move forward.
        let now = machine_cpu().map(|c| c.busy + c.idle);
        assert!(now.is_some_and(|t| t > 0), "/proc/stat gave {now:?}");
    }

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
