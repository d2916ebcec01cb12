//! The results table (Markdown): the machine, versions and parameters, every figure with a ratio
//! to a baseline measured in the same run, and each target with pass or miss.

use std::fmt::Write as _;
use std::time::Duration;

use super::admission::Cost;
use super::{CountResult, LagRow, Results};
use crate::binaries::{ETCD_VERSION, KARMADA_VERSION, KUBE_VERSION};
use crate::propagation::quantile;

/// The server-side timeout of a kube-runtime watch (its default): one renewal per stream per
/// this long.
pub const WATCH_RENEWAL: Duration = Duration::from_secs(290);

/// One target and how it went.
#[derive(Debug, Clone)]
pub struct Target {
    /// What is required.
    pub what: String,
    /// What was measured.
    pub measured: String,
    /// Whether it holds.
    pub pass: bool,
}

fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 10_000.0 {
        format!("{:.1} s", ms / 1e3)
    } else if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

fn opt_ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "–".to_owned(), ms)
}

fn ratio(a: Option<Duration>, b: Option<Duration>) -> Option<f64> {
    let (a, b) = (a?.as_secs_f64(), b?.as_secs_f64());
    (b > 0.0).then_some(a / b)
}

fn x(r: Option<f64>) -> String {
    r.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}×"))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn count(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn pass(p: bool) -> &'static str {
    if p { "**pass**" } else { "**miss**" }
}

/// Hub requests per acknowledged cell write, with the verbs: `1.80 (get 0.25, patch 1.30, …)`.
fn per_write(row: &LagRow, relay: bool) -> String {
    if relay {
        return "1 per cell event".to_owned();
    }
    let writes = row.stats.acked.max(1) as f64;
    let total: u64 = row.hub_requests.values().sum();
    let verbs: Vec<String> = row
        .hub_requests
        .iter()
        .map(|(verb, n)| format!("{verb} {:.2}", *n as f64 / writes))
        .collect();
    format!("{:.2} ({})", total as f64 / writes, verbs.join(", "))
}

/// CPU per acknowledged cell write of the hub's apiserver and of the mirror: `0.84 / 0.11 ms`.
fn cpu_per_write(row: &LagRow) -> String {
    let (hub, mirror) = row.cpu_per_write_ms();
    let ms = |v: Option<f64>| v.map_or_else(|| "?".to_owned(), |v| format!("{v:.2}"));
    format!("{} / {} ms", ms(hub), ms(mirror))
}

/// The machine's CPU over the churn: `97 % (steal 2 %)`, or `?`.
fn machine_busy(row: &LagRow) -> String {
    row.machine
        .and_then(crate::bench::system::MachineCpu::shares)
        .map_or_else(
            || "?".to_owned(),
            |(busy, steal)| format!("{busy:.0} % (steal {steal:.0} %)"),
        )
}

/// What the admission policies add per write: (`with` − `without`, `with` ÷ `without`), from
/// the hub's CPU per write with the policies in force and suspended (milliseconds).
pub fn difference(with: Option<f64>, without: Option<f64>) -> (Option<f64>, Option<f64>) {
    match (with, without) {
        (Some(with), Some(without)) => (Some(with - without), (without > 0.0).then(|| with / without)),
        _ => (None, None),
    }
}

/// Section 6: the hub's CPU per write with the admission policies in force and suspended, one
/// row per object count (`None`: not measured).
pub fn admission_section(counts: &[(usize, Option<&Cost>)], rate: f64, windows: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## 6. Admission policies\n\nWhat the hub's ValidatingAdmissionPolicies (`config/rbac/hub/admission_policy.yaml`: each location's identity may write only its own copies and Lease) cost it per write. The replicator churns at {rate}/s, {windows} windows with the policies in force and {windows} with their bindings removed, alternating (in force, suspended, suspended, in force …) over the same load, each pooled; a probe write the location policy refuses, made as a location identity of its own in a scratch namespace, tells when a removal or a restoration has taken effect (both within the deadline, before the next window). *Hub CPU per write*: the hub kube-apiserver's CPU time from each window's start to its settling over the cell writes, as in section 1 (the hub's background alike in both). The relay of section 1 writes through the same policies (as locations of its own, `dfw-relay` and `sjc-relay`), as the replicator does there.\n"
    );
    let _ = writeln!(
        s,
        "| objects | rate asked | writes: in force / suspended (achieved/s) | hub requests per write: in force / suspended | hub CPU per write: policies in force | suspended | difference | ÷ suspended | p99 lag: in force / suspended |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut notes = Vec::new();
    for (objects, cost) in counts {
        let Some(cost) = cost else {
            let _ = writeln!(
                s,
                "| {} | {rate} | not measured: the hub has no binding of the replicator's admission policies | | | | | | |",
                count(*objects)
            );
            continue;
        };
        let (with, without) = cost.hub_cpu_per_write_ms();
        let (diff, r) = difference(with, without);
        let requests = |row: &LagRow| {
            let total: u64 = row.hub_requests.values().sum();
            format!("{:.2}", total as f64 / row.stats.acked.max(1) as f64)
        };
        let per = |v: Option<f64>| v.map_or_else(|| "?".to_owned(), |v| format!("{v:.2} ms"));
        let p99 = |row: &LagRow| opt_ms(quantile(&row.lags, 0.99));
        let _ = writeln!(
            s,
            "| {} | {} | {} ({:.0}) / {} ({:.0}) | {} / {} | {} | {} | {} | {} | {} / {} |",
            count(*objects),
            cost.in_force.stats.rate,
            cost.in_force.stats.acked,
            cost.in_force.stats.achieved(),
            cost.suspended.stats.acked,
            cost.suspended.stats.achieved(),
            requests(&cost.in_force),
            requests(&cost.suspended),
            per(with),
            per(without),
            diff.map_or_else(|| "?".to_owned(), |d| format!("{d:+.2} ms")),
            x(r),
            p99(&cost.in_force),
            p99(&cost.suspended),
        );
        notes.push(format!(
            "{} objects: bindings suspended {}; each removal and restoration took effect within {} of its first binding write (the probe's answer){}",
            count(*objects),
            cost.bindings
                .iter()
                .map(|b| format!("`{b}`"))
                .collect::<Vec<_>>()
                .join(", "),
            ms(cost.switch),
            if cost.in_force.missing + cost.suspended.missing > 0 {
                format!(
                    "; writes missing: {} in force, {} suspended",
                    cost.in_force.missing, cost.suspended.missing
                )
            } else {
                String::new()
            }
        ));
    }
    if !notes.is_empty() {
        let _ = writeln!(s, "\n{}.", notes.join(". "));
    }
    s
}

/// The row of `rate` in `rows` (matched within 1 %).
fn at_rate(rows: &[LagRow], rate: f64) -> Option<&LagRow> {
    rows.iter().find(|r| (r.stats.rate - rate).abs() <= rate.abs() * 0.01)
}

/// Idle requests of the rest window (the Lease's and the cell probe's are counted apart; the
/// sweep walks the hub cache and makes none at rest).
fn idle_requests(c: &CountResult) -> u64 {
    c.rest.total()
}

/// Watch renewals per minute the two processes' streams make.
fn renewals_per_minute(c: &CountResult) -> f64 {
    c.rest.watch_streams as f64 * 60.0 / WATCH_RENEWAL.as_secs_f64()
}

/// The most requests the streams may make in the window: one renewal each per started
/// [`WATCH_RENEWAL`].
fn renewal_bound(c: &CountResult) -> u64 {
    let per_stream = (c.rest.window.as_secs_f64() / WATCH_RENEWAL.as_secs_f64())
        .ceil()
        .max(1.0) as u64;
    c.rest.watch_streams * per_stream
}

/// Resident bytes per mirrored object: marginal between the smallest and largest count when there
/// are two, else the replicators' peak above the relays' over the count.
fn bytes_per_object(results: &Results) -> Option<(f64, String)> {
    let first = results.counts.first()?;
    let last = results.counts.last()?;
    if last.objects > first.objects {
        let delta = peak(last) as f64 - peak(first) as f64;
        Some((
            delta / (last.objects - first.objects) as f64,
            format!("marginal, {} → {} objects", count(first.objects), count(last.objects)),
        ))
    } else {
        let above_relay = peak(last) as f64 - last.relay.total_peak_rss() as f64;
        Some((
            above_relay / last.objects.max(1) as f64,
            "the replicators' peak above the relays' (which cache nothing), ÷ objects".to_owned(),
        ))
    }
}

/// Peak RSS of the replicators at a count: both processes, over the run and the restart.
fn peak(c: &CountResult) -> u64 {
    c.replicator
        .peak_rss
        .iter()
        .map(|(location, p)| (*p).max(c.rest.peak_rss.get(location).copied().unwrap_or(0)))
        .sum()
}

/// The targets of issue #5, judged at every count.
pub fn targets(results: &Results) -> Vec<Target> {
    let o = &results.options;
    let mut out = Vec::new();
    for c in &results.counts {
        let n = count(c.objects);
        let replicator = at_rate(&c.replicator.rows, o.target_rate);
        let relay = at_rate(&c.relay.rows, o.target_rate);
        let rep_p99 = replicator.and_then(|r| quantile(&r.lags, 0.99));
        let relay_p99 = relay.and_then(|r| quantile(&r.lags, 0.99));
        let r = ratio(rep_p99, relay_p99);
        let complete = replicator.is_some_and(|r| r.missing == 0);
        out.push(Target {
            what: format!("p99 lag at {}/s ≤ 1.5 × relay p99 ({n} objects)", o.target_rate),
            measured: format!(
                "{} ({} vs {}){}",
                x(r),
                opt_ms(rep_p99),
                opt_ms(relay_p99),
                if complete { "" } else { ", writes missing" }
            ),
            pass: complete && r.is_some_and(|r| r <= 1.5),
        });
        let rep_p50 = replicator.and_then(|r| quantile(&r.lags, 0.5));
        let karmada_p50 = quantile(&c.karmada.all_sorted(), 0.5);
        let r = ratio(rep_p50, karmada_p50);
        out.push(Target {
            what: format!("p50 lag at {}/s ≤ 0.25 × Karmada's p50 ({n} objects)", o.target_rate),
            measured: format!("{} ({} vs {})", x(r), opt_ms(rep_p50), opt_ms(karmada_p50)),
            pass: r.is_some_and(|r| r <= 0.25),
        });
        let per_sweep = c.rest.idle_hub_writes as f64 / c.rest.sweeps.max(1) as f64;
        out.push(Target {
            what: format!("zero hub writes per sweep at rest ({n} copies)"),
            measured: format!(
                "{per_sweep:.1} ({} writes in {} sweeps)",
                c.rest.idle_hub_writes, c.rest.sweeps
            ),
            pass: c.rest.idle_hub_writes == 0 && c.rest.sweeps > 0,
        });
        let extra = idle_requests(c);
        out.push(Target {
            what: format!(
                "no relist storm: idle requests (besides the Lease and the cell probe) ≤ watch renewals ({n} copies)"
            ),
            measured: format!(
                "{extra} in {:.0} s (bound {}: {} streams × one renewal per {} s)",
                c.rest.window.as_secs_f64(),
                renewal_bound(c),
                c.rest.watch_streams,
                WATCH_RENEWAL.as_secs()
            ),
            pass: extra <= renewal_bound(c),
        });
        out.push(Target {
            what: format!("restart over {n} correct copies: ready ≤ 10 s"),
            measured: ms(c.rest.ready),
            pass: c.rest.ready <= Duration::from_secs(10),
        });
        out.push(Target {
            what: format!("restart over {n} correct copies: zero writes"),
            measured: format!(
                "{} hub write requests ({} copy writes)",
                c.rest.restart_hub_write_requests, c.rest.restart_writes
            ),
            pass: c.rest.restart_hub_write_requests == 0,
        });
        if c.objects >= 10_000 || c.objects == results.counts.iter().map(|c| c.objects).max().unwrap_or(0) {
            let total = peak(c);
            out.push(Target {
                what: format!("peak RSS at {n} objects ≤ 100 MB (both processes together)"),
                measured: format!("{:.1} MB", mb(total)),
                pass: mb(total) <= 100.0,
            });
        }
    }
    out
}

/// The whole report.
pub fn markdown(results: &Results) -> String {
    let o = &results.options;
    let m = &results.machine;
    let mut s = String::new();
    let _ = writeln!(s, "# replicator benchmark ({})\n", o.mode);
    let _ = writeln!(
        s,
        "- **Machine**: {} cores ({}), {:.1} GiB RAM, Linux {}; load average {} at the start; run took {:.1} min.",
        m.cores,
        m.cpu,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.kernel,
        m.load_at_start
            .map_or_else(|| "unknown".to_owned(), |l| format!("{l:.2}")),
        results.elapsed.as_secs_f64() / 60.0
    );
    let _ = writeln!(
        s,
        "- **Versions**: replicator {} (`{}`, {} build; bench and relay {} build), Kubernetes {KUBE_VERSION}, Karmada {KARMADA_VERSION}, etcd {ETCD_VERSION}.",
        results.revision,
        o.replicator_bin.display(),
        profile_of(&o.replicator_bin),
        if cfg!(debug_assertions) { "debug" } else { "release" },
    );
    let _ = writeln!(
        s,
        "- **Parameters**: objects {} (each split evenly over cell-a/`dfw`, cell-b/`sjc` × galactic EndpointSlices, NetworkInterfaces); churn {} writes/s, {:.0} s each, cycling update, create, update, delete (population constant), the mirrors over disjoint sources of as many objects and taking turns, {} windows each at {}/s (order A B B A …, pooled); settle ≤ {:.0} s; `--workers {}` (the relay: {} writers per process); both mirrors with least-privilege identities, their hub writes under the hub's admission policies (the relay's as locations of its own, `dfw-relay` and `sjc-relay`); admission cost: {} windows each with the policies in force and suspended at {}/s; restart with `--sweep-interval {:.0}s`, idle window {:.0} s; Karmada: as many ConfigMaps at {}/s to `{}`.",
        o.counts.iter().map(|c| count(*c)).collect::<Vec<_>>().join(", "),
        o.rates.iter().map(|r| format!("{r}")).collect::<Vec<_>>().join(", "),
        o.churn.as_secs_f64(),
        o.target_windows,
        o.target_rate,
        o.settle.as_secs_f64(),
        o.workers,
        o.workers,
        o.target_windows,
        o.target_rate,
        o.sweep_interval.as_secs_f64(),
        o.idle.as_secs_f64(),
        o.peer_rate,
        o.peer_member,
    );
    for warning in &results.warnings {
        let _ = writeln!(s, "- **Warning**: {warning}");
    }

    let _ = writeln!(s, "\n## Targets\n");
    let _ = writeln!(s, "| target | measured | result |\n|---|---|---|");
    for t in targets(results) {
        let _ = writeln!(s, "| {} | {} | {} |", t.what, t.measured, pass(t.pass));
    }

    let _ = writeln!(
        s,
        "\n## 1. Propagation lag\n\nCell write acknowledged → the copy's event in a hub watch. Baseline: the relay (watch, server-side apply, nothing else; its hub writes admitted by the same policies as the replicator's, section 6) over the same load; ratios are replicator ÷ relay. *Missing*: writes the hub never showed within the settle time; *never published*: writes to objects created and deleted before any copy of them appeared (a mirror that coalesces skips them, the hub ends right; they are not in the percentiles, and are only seen when a mirror lags by more than an object's life). *CPU per write*: CPU time of the hub's kube-apiserver and of the mirror's processes from the window's start to its settling, over the writes: what each write costs, a figure that does not swing with the machine's stalls as tail lags do (the hub's background, Karmada's watches and the lag watch, is in both mirrors' figures alike). *Machine busy*: the share of all cores' time spent running anything during the churn (from `/proc/stat`; *steal*: time the hypervisor gave to other guests). Near 100 % the machine is saturated: every process, both mirrors' and the apiservers', waits for a core, and a few percent more work per write turns into a long queue, so tail lags there swing far more than the CPU figures.\n"
    );
    let _ = writeln!(
        s,
        "| objects | rate asked | mirror | writes (achieved/s) | missing | hub requests per write | CPU per write: hub apiserver / mirror | machine busy | p50 | p95 | p99 | max | p50 ÷ relay | p95 ÷ relay | p99 ÷ relay | max ÷ relay |\n|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for c in &results.counts {
        for (rep, rel) in c.replicator.rows.iter().zip(&c.relay.rows) {
            let q = |r: &LagRow, p: f64| quantile(&r.lags, p);
            for (name, row) in [("replicator", rep), ("relay", rel)] {
                let ratios: Vec<String> = [0.5, 0.95, 0.99, 1.0]
                    .iter()
                    .map(|&p| {
                        if name == "relay" {
                            "1.00×".to_owned()
                        } else {
                            x(ratio(q(rep, p), q(rel, p)))
                        }
                    })
                    .collect();
                let _ = writeln!(
                    s,
                    "| {} | {} | {name} | {} ({:.0}) | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    count(c.objects),
                    row.stats.rate,
                    row.stats.acked,
                    row.stats.achieved(),
                    if row.never_published > 0 {
                        format!("{} (+{} never published)", row.missing, row.never_published)
                    } else {
                        row.missing.to_string()
                    },
                    per_write(row, name == "relay"),
                    cpu_per_write(row),
                    machine_busy(row),
                    opt_ms(q(row, 0.5)),
                    opt_ms(q(row, 0.95)),
                    opt_ms(q(row, 0.99)),
                    opt_ms(q(row, 1.0)),
                    ratios.join(" | "),
                );
            }
        }
    }

    let _ = writeln!(
        s,
        "\nWhere the replicator's lag goes, from its own histograms over the same windows (both processes; bucket upper bounds, so each figure is an upper estimate within a factor of two): a key waiting for a worker (`replicator_queue_wait_seconds`), one pass over it, every hub round trip included (`replicator_sync_duration_seconds`), and the hub answering one server-side apply (`replicator_api_request_duration_seconds{{cluster=\"hub\",verb=\"patch\"}}`). Queue wait growing while passes stay short would mean too few workers; passes growing with the hub's answers, a slow hub.\n"
    );
    let _ = writeln!(
        s,
        "| objects | rate asked | passes | queue wait p50 / p99 | sync pass p50 / p99 | hub apply p50 / p99 |\n|---:|---:|---:|---:|---:|---:|"
    );
    for c in &results.counts {
        for row in &c.replicator.rows {
            let Some(stages) = &row.stages else { continue };
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {} | {} | {} |",
                count(c.objects),
                row.stats.rate,
                stages.sync.count(),
                super::stage(&stages.queue_wait),
                super::stage(&stages.sync),
                super::stage(&stages.hub_patch),
            );
        }
    }

    let _ = writeln!(
        s,
        "\nThe lag at {}/s by what the cell write did: a create costs the replicator a read (its cache has no copy, and the name may be taken by an object not its own) before the apply; an update, one apply; a delete, one delete. The relay makes one request for each.\n",
        o.target_rate
    );
    let _ = writeln!(
        s,
        "| objects | write | replicator p50 / p99 | relay p50 / p99 | p99 ÷ relay |\n|---:|---|---:|---:|---:|"
    );
    for c in &results.counts {
        let (Some(rep), Some(rel)) = (
            at_rate(&c.replicator.rows, o.target_rate),
            at_rate(&c.relay.rows, o.target_rate),
        ) else {
            continue;
        };
        for op in super::lag::Op::ALL {
            let of = |r: &LagRow, p: f64| r.by_op.get(&op).and_then(|l| quantile(l, p));
            let _ = writeln!(
                s,
                "| {} | {} | {} / {} | {} / {} | {} |",
                count(c.objects),
                op.name(),
                opt_ms(of(rep, 0.5)),
                opt_ms(of(rep, 0.99)),
                opt_ms(of(rel, 0.5)),
                opt_ms(of(rel, 0.99)),
                x(ratio(of(rep, 0.99), of(rel, 0.99))),
            );
        }
    }

    let _ = writeln!(
        s,
        "\n## 2. Peer: Karmada's own propagation\n\nHub create acknowledged → the member's watch event, as many objects as the count. Ratio: the replicator's p50 at {}/s ÷ Karmada's p50.\n",
        o.target_rate
    );
    let _ = writeln!(
        s,
        "| objects | member | copies seen | p50 | p99 | max | replicator p50 at {}/s | ÷ Karmada p50 |\n|---:|---|---:|---:|---:|---:|---:|---:|",
        o.target_rate
    );
    for c in &results.counts {
        let all = c.karmada.all_sorted();
        let rep_p50 = at_rate(&c.replicator.rows, o.target_rate).and_then(|r| quantile(&r.lags, 0.5));
        let _ = writeln!(
            s,
            "| {} | {} | {}{} | {} | {} | {} | {} | {} |",
            count(c.objects),
            o.peer_member,
            all.len(),
            if c.karmada.complete.is_ok() {
                ""
            } else {
                " (incomplete)"
            },
            opt_ms(quantile(&all, 0.5)),
            opt_ms(quantile(&all, 0.99)),
            opt_ms(quantile(&all, 1.0)),
            opt_ms(rep_p50),
            x(ratio(rep_p50, quantile(&all, 0.5))),
        );
    }

    let _ = writeln!(
        s,
        "\n## 3. Cost at rest\n\nThe replicators restarted over correct copies with `--sweep-interval {:.0}s`, then left idle; requests counted by the replicators (`replicator_api_requests_total`). Baseline: watch renewals, one request per stream per {} s (kube-runtime's watch timeout); the sweep walks the hub cache (no LIST); leader election's Lease requests (renewals) and the unreachable-cell probe (`/version` every 2 s per cell) are shown apart.\n",
        o.sweep_interval.as_secs_f64(),
        WATCH_RENEWAL.as_secs()
    );
    let _ = writeln!(
        s,
        "| objects | idle window | sweeps | hub writes per sweep | requests (watch / list / get / other) | Lease (leader election) | cell probe | the rest, per min | baseline: renewals per min ({} streams) | ÷ baseline |\n|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        results.counts.first().map_or(0, |c| c.rest.watch_streams)
    );
    for c in &results.counts {
        let r = &c.rest;
        let minutes = r.window.as_secs_f64() / 60.0;
        let extra = idle_requests(c) as f64 / minutes.max(1e-9);
        let renewals = renewals_per_minute(c);
        let other = r.total() - r.verb("watch") - r.verb("list") - r.verb("get");
        let _ = writeln!(
            s,
            "| {} | {:.0} s | {} | {:.1} | {} ({} / {} / {} / {}) | {} | {} | {:.1} | {:.2} | {} |",
            count(c.objects),
            r.window.as_secs_f64(),
            r.sweeps,
            r.idle_hub_writes as f64 / r.sweeps.max(1) as f64,
            r.total(),
            r.verb("watch"),
            r.verb("list"),
            r.verb("get"),
            other,
            r.lease_requests,
            r.probe_requests,
            extra,
            renewals,
            x((renewals > 0.0).then_some(extra / renewals)),
        );
    }

    let _ = writeln!(
        s,
        "\n## 4. Memory\n\nPeak RSS (`VmHWM`) of the two replicator processes together, over the churn run and the restart. Baseline: the two relay processes (no cache) over the same load.\n"
    );
    let _ = writeln!(
        s,
        "| objects | replicator peak RSS (per location) | total | relay total | ÷ relay |\n|---:|---|---:|---:|---:|"
    );
    for c in &results.counts {
        let per: Vec<String> = c
            .replicator
            .peak_rss
            .iter()
            .map(|(l, p)| format!("{l} {}", mib((*p).max(c.rest.peak_rss.get(l).copied().unwrap_or(0)))))
            .collect();
        let relay = c.relay.total_peak_rss();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            count(c.objects),
            per.join(", "),
            mib(peak(c)),
            mib(relay),
            x((relay > 0).then(|| peak(c) as f64 / relay as f64)),
        );
    }
    if let Some((bytes, how)) = bytes_per_object(results) {
        let _ = writeln!(s, "\nBytes per mirrored object: {bytes:.0} ({how}).");
    }

    let _ = writeln!(
        s,
        "\n## 5. Start-up\n\nRestart over correct copies: process start → `/readyz` 200 (slower process), baseline one plain LIST of every source and copy it reads; writes from start until every copy is re-verified and the start-up sweep is done. Empty hub: process start → every copy present in the hub watch, baseline the relay.\n"
    );
    let _ = writeln!(
        s,
        "| objects | restart: ready | LIST floor | ÷ floor | re-verified | hub write requests | empty hub: replicator | relay | ÷ relay |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for c in &results.counts {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            count(c.objects),
            ms(c.rest.ready),
            ms(c.rest.list_floor),
            x(ratio(Some(c.rest.ready), Some(c.rest.list_floor))),
            ms(c.rest.verified),
            c.rest.restart_hub_write_requests,
            ms(c.replicator.startup_all_present),
            ms(c.relay.startup_all_present),
            x(ratio(
                Some(c.replicator.startup_all_present),
                Some(c.relay.startup_all_present)
            )),
        );
    }
    let admission: Vec<(usize, Option<&Cost>)> = results
        .counts
        .iter()
        .map(|c| (c.objects, c.admission.as_ref()))
        .collect();
    s.push_str(&admission_section(&admission, o.target_rate, o.target_windows));
    let _ = writeln!(s, "\n![lag distributions](lag.png)");
    s
}

/// `release` or `debug` from a binary's path under a Cargo target directory.
fn profile_of(path: &std::path::Path) -> &'static str {
    if path.components().any(|c| c.as_os_str() == "release") {
        "release"
    } else if path.components().any(|c| c.as_os_str() == "debug") {
        "debug"
    } else {
        "unknown"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_formatted_for_people() {
        assert_eq!(count(10_000), "10,000");
        assert_eq!(count(200), "200");
        assert_eq!(ms(Duration::from_micros(4_300)), "4.3 ms");
        assert_eq!(ms(Duration::from_millis(1_234)), "1234 ms");
        assert_eq!(ms(Duration::from_secs(12)), "12.0 s");
        assert_eq!(
            x(ratio(Some(Duration::from_millis(3)), Some(Duration::from_millis(2)))),
            "1.50×"
        );
        assert_eq!(x(ratio(Some(Duration::from_millis(3)), None)), "–");
        assert_eq!(
            profile_of(std::path::Path::new("/w/target/release/replicator")),
            "release"
        );
    }

    /// A pooled row of `acked` writes at `rate` over `elapsed`, the hub spending `hub_cpu`.
    fn row(rate: f64, acked: usize, elapsed: Duration, hub_cpu: Option<Duration>, patches: u64) -> LagRow {
        let mut row = LagRow::pooled(Vec::new());
        row.stats.rate = rate;
        row.stats.acked = acked;
        row.stats.elapsed = elapsed;
        row.windows = 2;
        row.hub_cpu = hub_cpu;
        row.hub_requests.insert("patch".to_owned(), patches);
        row.lags = vec![Duration::from_millis(5); 90];
        row.lags.extend([Duration::from_millis(40); 10]);
        row
    }

    #[test]
    fn the_admission_cost_is_the_difference_and_ratio_of_cpu_per_write() {
        assert_eq!(
            difference(Some(1.2), Some(1.0)).0.map(|d| (d * 100.0).round()),
            Some(20.0)
        );
        assert_eq!(
            difference(Some(1.2), Some(1.0)).1.map(|r| (r * 100.0).round()),
            Some(120.0)
        );
        assert_eq!(difference(Some(1.2), Some(0.0)), (Some(1.2), None), "no ratio to zero");
        assert_eq!(difference(None, Some(1.0)), (None, None));
        assert_eq!(difference(Some(1.0), None), (None, None));
    }

    #[test]
    fn section_6_gives_hub_cpu_per_write_with_and_without_the_policies() {
        let cost = Cost {
            // 800 writes, 960 ms of hub CPU: 1.20 ms per write; 600 ms over 800: 0.75 ms.
            in_force: row(
                200.0,
                800,
                Duration::from_secs(4),
                Some(Duration::from_millis(960)),
                1000,
            ),
            suspended: row(
                200.0,
                800,
                Duration::from_secs(4),
                Some(Duration::from_millis(600)),
                1000,
            ),
            bindings: vec![
                "replicator-membership-e2e".to_owned(),
                "replicator-location-e2e".to_owned(),
            ],
            switch: Duration::from_millis(120),
        };
        let text = admission_section(&[(200, Some(&cost)), (1_000, None)], 200.0, 2);
        assert!(text.starts_with("\n## 6. Admission policies\n"), "{text}");
        assert!(
            text.contains("| 200 | 200 | 800 (200) / 800 (200) | 1.25 / 1.25 | 1.20 ms | 0.75 ms | +0.45 ms | 1.60× | 40.0 ms / 40.0 ms |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| 1,000 | 200 | not measured: the hub has no binding of the replicator's admission policies |"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "200 objects: bindings suspended `replicator-membership-e2e`, `replicator-location-e2e`; each removal and restoration took effect within 120 ms of its first binding write (the probe's answer)."
            ),
            "{text}"
        );
        assert!(text.contains("2 windows with the policies in force and 2 with their bindings removed"));

        let unread = Cost {
            suspended: row(200.0, 800, Duration::from_secs(4), None, 1000),
            ..cost
        };
        let text = admission_section(&[(200, Some(&unread))], 200.0, 2);
        assert!(text.contains("| 1.20 ms | ? | ? | – |"), "{text}");
    }
}
