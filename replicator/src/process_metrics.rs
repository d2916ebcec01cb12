//! The process metrics Prometheus' client libraries export, with their conventional, unprefixed
//! names, read from `/proc` at scrape time (Linux only; elsewhere nothing is exported):
//!
//! | metric | type | source |
//! | --- | --- | --- |
//! | `process_cpu_seconds_total` | counter | `utime + stime` of `/proc/self/stat`, in clock ticks |
//! | `process_resident_memory_bytes` | gauge | `VmRSS` of `/proc/self/status` |
//! | `process_virtual_memory_bytes` | gauge | `vsize` of `/proc/self/stat` |
//! | `process_open_fds` | gauge | entries of `/proc/self/fd` |
//! | `process_max_fds` | gauge | soft `Max open files` of `/proc/self/limits` |
//! | `process_start_time_seconds` | gauge | `btime` of `/proc/stat` + `starttime` of `/proc/self/stat` |
//!
//! Clock ticks are `USER_HZ`, 100 on every Linux architecture's `/proc` ABI (client_golang's
//! procfs assumes the same). The resident size comes from `VmRSS` (kB) rather than `statm`
//! (pages): the page size needs `sysconf`, an unsafe call this crate forbids; both count the same
//! pages. A value that cannot be read is left out of that scrape; the others are still exported.

use std::fmt;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

/// Clock ticks per second of the times in `/proc/<pid>/stat` (`USER_HZ`).
const USER_HZ: f64 = 100.0;

/// A [`Collector`] reading the process metrics from `/proc` on every scrape. Register it in the
/// root registry (no prefix): the names are the conventional `process_*` ones.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessCollector;

/// The fields of `/proc/self/stat` the metrics use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// User-mode CPU time, in clock ticks (field 14).
    pub utime: u64,
    /// Kernel-mode CPU time, in clock ticks (field 15).
    pub stime: u64,
    /// Start time after boot, in clock ticks (field 22).
    pub starttime: u64,
    /// Virtual memory size in bytes (field 23).
    pub vsize: u64,
}

impl Stat {
    /// CPU seconds, user and system.
    pub fn cpu_seconds(&self) -> f64 {
        // Tick counts stay far below 2^52 (a century of CPU time is ~3e11 ticks): exact in f64.
        #[allow(clippy::cast_precision_loss)]
        let ticks = (self.utime + self.stime) as f64;
        ticks / USER_HZ
    }

    /// Unix time the process started, given the boot time `btime` (Unix seconds).
    pub fn start_time_seconds(&self, btime: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let (boot, ticks) = (btime as f64, self.starttime as f64);
        boot + ticks / USER_HZ
    }
}

/// Parses `/proc/<pid>/stat`. The command (field 2) is in parentheses and may hold spaces and
/// parentheses, so the fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    // rest starts at field 3 (state): field N is at index N - 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
        vsize: field(23)?,
    })
}

/// The boot time (`btime`, Unix seconds) of `/proc/stat`.
pub fn parse_btime(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The resident set size in bytes: `VmRSS:  <n> kB` of `/proc/<pid>/status`.
pub fn parse_vm_rss(text: &str) -> Option<u64> {
    let value = text.lines().find_map(|line| line.strip_prefix("VmRSS:"))?;
    let kb = value.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kb.checked_mul(1024)
}

/// The soft limit of open files in `/proc/<pid>/limits`; `None` when unlimited.
pub fn parse_max_fds(text: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with("Max open files"))?;
    line.strip_prefix("Max open files")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Open file descriptors: the entries of `/proc/self/fd` (the one reading it included, as
/// client_golang counts).
fn open_fds() -> Option<u64> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    u64::try_from(entries.count()).ok()
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The values of one scrape; `None` for what could not be read.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Sample {
    /// `process_cpu_seconds_total`.
    pub cpu_seconds: Option<f64>,
    /// `process_resident_memory_bytes`.
    pub resident_memory_bytes: Option<u64>,
    /// `process_virtual_memory_bytes`.
    pub virtual_memory_bytes: Option<u64>,
    /// `process_open_fds`.
    pub open_fds: Option<u64>,
    /// `process_max_fds`.
    pub max_fds: Option<u64>,
    /// `process_start_time_seconds`.
    pub start_time_seconds: Option<f64>,
}

impl Sample {
    /// Reads this process's values from `/proc` (all `None` where there is no `/proc`).
    pub fn read() -> Self {
        let stat = read("/proc/self/stat").as_deref().and_then(parse_stat);
        let btime = read("/proc/stat").as_deref().and_then(parse_btime);
        Self {
            cpu_seconds: stat.map(|s| s.cpu_seconds()),
            resident_memory_bytes: read("/proc/self/status").as_deref().and_then(parse_vm_rss),
            virtual_memory_bytes: stat.map(|s| s.vsize),
            open_fds: open_fds(),
            max_fds: read("/proc/self/limits").as_deref().and_then(parse_max_fds),
            start_time_seconds: stat.zip(btime).map(|(s, b)| s.start_time_seconds(b)),
        }
    }
}

fn gauge(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, value: Option<u64>) -> fmt::Result {
    let Some(value) = value else { return Ok(()) };
    let metric = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let sample = Sample::read();
        if let Some(seconds) = sample.cpu_seconds {
            let metric = ConstCounter::new(seconds);
            // A counter's samples get the `_total` suffix: process_cpu_seconds_total.
            metric.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                metric.metric_type(),
            )?)?;
        }
        gauge(
            &mut encoder,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            sample.resident_memory_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            sample.virtual_memory_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_open_fds",
            "Number of open file descriptors.",
            sample.open_fds,
        )?;
        gauge(
            &mut encoder,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            sample.max_fds,
        )?;
        if let Some(start) = sample.start_time_seconds {
            let metric = ConstGauge::new(start);
            metric.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                None,
                metric.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;

    // A real line of /proc/<pid>/stat, with a command holding a space and a parenthesis.
    const STAT: &str = "4242 (repl (x) y) S 1 4242 4242 0 -1 4194560 2280 0 0 0 \
        150 75 0 0 20 0 9 0 123456 1234567890 4000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let stat = parse_stat(STAT).unwrap();
        assert_eq!(
            stat,
            Stat {
                utime: 150,
                stime: 75,
                starttime: 123_456,
                vsize: 1_234_567_890
            }
        );
        assert!((stat.cpu_seconds() - 2.25).abs() < 1e-9);
        assert!((stat.start_time_seconds(1_700_000_000) - 1_700_001_234.56).abs() < 1e-6);
        assert_eq!(parse_stat("4242 (cut) S 1 2"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn btime_rss_and_fd_limit_parse() {
        let proc_stat = "cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 5\nctxt 99\nbtime 1754000000\nprocesses 12\n";
        assert_eq!(parse_btime(proc_stat), Some(1_754_000_000));
        assert_eq!(parse_btime("cpu 1\n"), None);
        let status = "Name:\treplicator\nVmPeak:\t  200000 kB\nVmRSS:\t   51200 kB\nThreads:\t9\n";
        assert_eq!(parse_vm_rss(status), Some(51_200 * 1024));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
            Max processes             127431               127431               processes \n\
            Max open files            1048576              1048576              files     \n";
        assert_eq!(parse_max_fds(limits), Some(1_048_576));
        assert_eq!(
            parse_max_fds("Max open files            unlimited            unlimited            files\n"),
            None
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_measured_at_scrape_time() {
        let sample = Sample::read();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = sample.start_time_seconds.unwrap();
        // The test binary started before this line and, on any CI, less than a day ago; btime and
        // starttime are whole seconds and ticks, so allow a second of rounding.
        assert!(start <= now + 1.0 && start > now - 86_400.0, "start {start}, now {now}");
        assert!(sample.cpu_seconds.unwrap() >= 0.0);
        let rss = sample.resident_memory_bytes.unwrap();
        assert!(rss > 1 << 20, "a test binary holds more than 1 MiB: {rss}");
        assert!(sample.virtual_memory_bytes.unwrap() >= rss);
        // stdin, stdout, stderr and the directory being read, at least.
        assert!(sample.open_fds.unwrap() >= 3);

        let mut registry = Registry::default();
        registry.register_collector(Box::new(ProcessCollector));
        let text = crate::metrics::encode(&registry).unwrap();
        for (name, kind) in [
            ("process_cpu_seconds", "counter"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_virtual_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_start_time_seconds", "gauge"),
        ] {
            assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name} in\n{text}");
        }
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.parse::<f64>().ok())
        };
        assert!(value("process_cpu_seconds_total").is_some_and(|v| v >= 0.0), "{text}");
        assert!(
            value("process_resident_memory_bytes").is_some_and(|v| v > 1_048_576.0),
            "{text}"
        );
        assert!(value("process_open_fds").is_some_and(|v| v >= 3.0), "{text}");
        let scraped_start = value("process_start_time_seconds").unwrap();
        assert!((scraped_start - start).abs() < 1e-6, "{scraped_start} vs {start}");
    }
}
