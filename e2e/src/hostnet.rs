//! The host side of the cells' one-node clusters: the address pods and kubelets dial, the NAT
//! rule per cell that stands in for kube-proxy, `ip_forward`, bridges, mounts and cgroups, and
//! the teardown that leaves none of them behind.
//!
//! Facts this follows (from a trial of two one-node clusters on this kind of machine):
//! - a pod cannot reach the host's loopback, so whatever a pod dials (its cell's `kubernetes`
//!   Service, the hub in the mounted kubeconfig) is the host's primary address, and the
//!   apiservers listen on every address;
//! - one kube-proxy per cell would fight over the shared `KUBE-SERVICES` chain, so each cell gets
//!   one static DNAT rule from its pod range to its apiserver instead;
//! - every address handed out lies in the benchmarking range 198.18.0.0/15, so no packet of the
//!   harness can be taken for traffic to someone else's network.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use tokio::process::Command;

use crate::command::{run, run_checked};
use crate::error::{Error, Result, io_context};

/// The comment every iptables rule of the harness carries, so teardown finds exactly its own.
pub const RULE_COMMENT: &str = "replicator-e2e";

/// The host's primary IPv4 address: the source address of the interface that holds the default
/// route (`/proc/net/route`, then `ip -j -4 addr show dev <interface>`). Nothing is sent.
///
/// # Errors
/// No default route, or its interface has no IPv4 address.
pub async fn primary_address() -> Result<Ipv4Addr> {
    let routes = std::fs::read_to_string("/proc/net/route").map_err(io_context("reading /proc/net/route"))?;
    let interface = default_route_interface(&routes).ok_or_else(|| {
        Error::Config(
            "the host has no IPv4 default route: the cells' pods need a non-loopback host address to reach the apiservers"
                .to_owned(),
        )
    })?;
    let output = run_checked(Command::new("ip").args(["-j", "-4", "addr", "show", "dev", &interface])).await?;
    let json: serde_json::Value = serde_json::from_slice(&output.stdout)
        .map_err(|error| Error::Config(format!("`ip -j addr show dev {interface}` printed no JSON: {error}")))?;
    first_ipv4(&json).ok_or_else(|| Error::Config(format!("interface {interface} has no IPv4 address")))
}

/// The interface of the first default route in a `/proc/net/route` table.
fn default_route_interface(table: &str) -> Option<String> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&"00000000") && fields.get(7) == Some(&"00000000"))
            .then(|| fields.first().map(|name| (*name).to_owned()))
            .flatten()
    })
}

/// The first `addr_info[].local` of `ip -j addr show` output.
fn first_ipv4(json: &serde_json::Value) -> Option<Ipv4Addr> {
    json.as_array()?.iter().find_map(|link| {
        link.get("addr_info")?
            .as_array()?
            .iter()
            .find_map(|addr| addr.get("local")?.as_str()?.parse().ok())
    })
}

/// The arguments of the DNAT rule that sends a cell's pods' connections to its `kubernetes`
/// Service IP on to the apiserver: `-s <pod CIDR> -d <service IP>/32 -p tcp --dport 443 -j DNAT
/// --to-destination <host>:<port>`, with the harness's comment.
pub fn dnat_rule(pod_cidr: &str, service_ip: Ipv4Addr, host: Ipv4Addr, port: u16) -> Vec<String> {
    [
        "PREROUTING",
        "-s",
        pod_cidr,
        "-d",
        &format!("{service_ip}/32"),
        "-p",
        "tcp",
        "--dport",
        "443",
        "-m",
        "comment",
        "--comment",
        RULE_COMMENT,
        "-j",
        "DNAT",
        "--to-destination",
        &format!("{host}:{port}"),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Adds a NAT rule unless it is there (`iptables -t nat -C`, then `-A`).
pub async fn ensure_nat_rule(rule: &[String]) -> Result<()> {
    let present = run(Command::new("iptables").args(["-w", "-t", "nat", "-C"]).args(rule)).await?;
    if present.status.success() {
        return Ok(());
    }
    run_checked(Command::new("iptables").args(["-w", "-t", "nat", "-A"]).args(rule)).await?;
    Ok(())
}

/// Deletes every rule of the harness (those carrying [`RULE_COMMENT`]) from the nat table, and
/// the chains kubelets make (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, in every table, for
/// iptables and ip6tables). Returns what it removed, for the log.
pub async fn remove_rules_and_kubelet_chains() -> Result<Vec<String>> {
    let mut removed = Vec::new();
    if !iptables_installed() {
        // Rules are only ever added with iptables: a host without it holds none of ours.
        return Ok(removed);
    }
    let listing = run(Command::new("iptables").args(["-w", "-t", "nat", "-S"])).await?;
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        if !line.contains(RULE_COMMENT) {
            continue;
        }
        let Some(spec) = line.strip_prefix("-A ") else { continue };
        let args = shell_words(spec);
        let deleted = run(Command::new("iptables").args(["-w", "-t", "nat", "-D"]).args(&args)).await?;
        if deleted.status.success() {
            removed.push(format!("iptables -t nat {line}"));
        }
    }
    for tool in ["iptables", "ip6tables"] {
        for table in ["filter", "nat", "mangle"] {
            let listing = run(Command::new(tool).args(["-w", "-t", table, "-S"])).await?;
            let text = String::from_utf8_lossy(&listing.stdout).into_owned();
            for chain in KUBELET_CHAINS {
                if !text.lines().any(|line| line == format!("-N {chain}")) {
                    continue;
                }
                // Rules that jump to the chain first, then the chain itself.
                for line in text.lines() {
                    if let Some(spec) = line.strip_prefix("-A ")
                        && spec.contains(&format!("-j {chain}"))
                    {
                        let args = shell_words(spec);
                        run(Command::new(tool).args(["-w", "-t", table, "-D"]).args(&args)).await?;
                    }
                }
                run(Command::new(tool).args(["-w", "-t", table, "-F", chain])).await?;
                let gone = run(Command::new(tool).args(["-w", "-t", table, "-X", chain])).await?;
                if gone.status.success() {
                    removed.push(format!("{tool} -t {table} chain {chain}"));
                }
            }
        }
    }
    Ok(removed)
}

/// The harness's NAT rules and the kubelets' chains present now, one line each (for the
/// leftover check after teardown).
pub async fn rules_and_kubelet_chains() -> Result<Vec<String>> {
    let mut found = Vec::new();
    if !iptables_installed() {
        return Ok(found);
    }
    let listing = run(Command::new("iptables").args(["-w", "-t", "nat", "-S"])).await?;
    found.extend(
        String::from_utf8_lossy(&listing.stdout)
            .lines()
            .filter(|line| line.contains(RULE_COMMENT))
            .map(|line| format!("iptables -t nat {line}")),
    );
    for tool in ["iptables", "ip6tables"] {
        for table in ["filter", "nat", "mangle"] {
            let listing = run(Command::new(tool).args(["-w", "-t", table, "-S"])).await?;
            for chain in KUBELET_CHAINS {
                if String::from_utf8_lossy(&listing.stdout)
                    .lines()
                    .any(|line| line == format!("-N {chain}"))
                {
                    found.push(format!("{tool} -t {table} chain {chain}"));
                }
            }
        }
    }
    Ok(found)
}

/// Whether `iptables` is on `PATH`: a fresh host before `install-host-packages.sh` has none, and
/// then neither the harness nor a kubelet can have added a rule.
fn iptables_installed() -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("iptables").is_file()))
}

/// The chains a kubelet creates on start (its iptables utility and canary chains).
const KUBELET_CHAINS: [&str; 2] = ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"];

/// Splits an `iptables -S` rule into arguments (double-quoted words keep their spaces).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut started = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                started = true;
            }
            ' ' if !quoted => {
                if started {
                    words.push(std::mem::take(&mut current));
                    started = false;
                }
            }
            _ => {
                current.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(current);
    }
    words
}

/// `/proc/sys/net/ipv4/ip_forward` (the CNI bridge plugin turns it on).
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Reads `ip_forward` (`"0"` or `"1"`), to restore it on teardown.
pub fn ip_forward() -> Result<String> {
    std::fs::read_to_string(IP_FORWARD)
        .map(|value| value.trim().to_owned())
        .map_err(io_context(format!("reading {IP_FORWARD}")))
}

/// Writes `ip_forward` back.
pub fn restore_ip_forward(value: &str) -> Result<()> {
    std::fs::write(IP_FORWARD, value).map_err(io_context(format!("writing {IP_FORWARD}")))
}

/// Deletes a network interface if it exists (a cell's bridge); returns whether it did.
pub async fn delete_link(name: &str) -> Result<bool> {
    if !Path::new("/sys/class/net").join(name).exists() {
        return Ok(false);
    }
    run_checked(Command::new("ip").args(["link", "delete", name])).await?;
    Ok(true)
}

/// The mount points at or below `dir`, deepest first (from `/proc/self/mountinfo`).
pub fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(io_context("reading /proc/self/mountinfo"))?;
    Ok(mounts_below(&text, dir))
}

fn mounts_below(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut mounts: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|point| point.starts_with(dir))
        .collect();
    mounts.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    mounts.dedup();
    mounts
}

/// Mount points in mountinfo escape space, tab, newline and backslash as octal (`\040`).
fn unescape_mount_path(field: &str) -> PathBuf {
    let mut out = String::with_capacity(field.len());
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            match u8::from_str_radix(&code, 8) {
                Ok(byte) => out.push(char::from(byte)),
                Err(_) => {
                    out.push('\\');
                    out.push_str(&code);
                }
            }
        } else {
            out.push(c);
        }
    }
    PathBuf::from(out)
}

/// Unmounts everything at or below `dir`, deepest first (lazily, so a busy mount does not stop
/// the rest). Repeats until none is left (a bind mount may hide another below it). Returns the
/// mount points it unmounted.
pub fn unmount_all_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut unmounted = Vec::new();
    for _round in 0..8 {
        let mounts = mounts_under(dir)?;
        if mounts.is_empty() {
            break;
        }
        for point in mounts {
            match nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH) {
                Ok(()) => unmounted.push(point),
                Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
                Err(source) => {
                    return Err(io_context(format!("unmounting {}", point.display()))(
                        std::io::Error::from(source),
                    ));
                }
            }
        }
    }
    Ok(unmounted)
}

/// The cgroup v1 hierarchies (and the v2 `unified` one) mounted under `/sys/fs/cgroup`.
pub fn cgroup_hierarchies() -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(io_context("reading /proc/self/mountinfo"))?;
    let mut hierarchies: Vec<PathBuf> = text
        .lines()
        .filter(|line| line.contains(" - cgroup ") || line.contains(" - cgroup2 "))
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|point| point.starts_with("/sys/fs/cgroup"))
        .collect();
    hierarchies.sort();
    hierarchies.dedup();
    Ok(hierarchies)
}

/// Creates cgroup `name` (a top-level directory, the kubelet's `cgroupRoot`) in every hierarchy;
/// in the cpuset hierarchy it inherits its parent's CPUs and memory nodes (a v1 cpuset cgroup
/// starts empty and would accept no process).
pub fn create_cgroup_root(name: &str) -> Result<()> {
    for hierarchy in cgroup_hierarchies()? {
        let dir = hierarchy.join(name);
        if !dir.is_dir() {
            std::fs::create_dir(&dir).map_err(io_context(format!("creating cgroup {}", dir.display())))?;
        }
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let parent = hierarchy.join(file);
            if parent.is_file() {
                let value =
                    std::fs::read_to_string(&parent).map_err(io_context(format!("reading {}", parent.display())))?;
                let own = dir.join(file);
                if std::fs::read_to_string(&own)
                    .map(|v| v.trim().is_empty())
                    .unwrap_or(true)
                {
                    std::fs::write(&own, value.trim()).map_err(io_context(format!("writing {}", own.display())))?;
                }
            }
        }
    }
    Ok(())
}

/// Every process in cgroup `name` or below, in any hierarchy.
pub fn cgroup_processes(name: &str) -> Result<Vec<u32>> {
    let mut pids = Vec::new();
    for hierarchy in cgroup_hierarchies()? {
        for dir in cgroup_tree(&hierarchy.join(name)) {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(text.lines().filter_map(|line| line.trim().parse::<u32>().ok()));
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// Removes cgroup `name` and everything below it from every hierarchy, deepest first. A cgroup
/// that still holds a process cannot go: the error names it.
pub fn remove_cgroup_root(name: &str) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for hierarchy in cgroup_hierarchies()? {
        let mut tree = cgroup_tree(&hierarchy.join(name));
        tree.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
        for dir in tree {
            match std::fs::remove_dir(&dir) {
                Ok(()) => removed.push(dir),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(io_context(format!("removing cgroup {}", dir.display()))(error)),
            }
        }
    }
    Ok(removed)
}

/// `root` and every directory below it (a cgroup tree), or nothing if `root` does not exist.
fn cgroup_tree(root: &Path) -> Vec<PathBuf> {
    let mut tree = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                pending.push(entry.path());
            }
        }
        tree.push(dir);
    }
    tree
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_route_names_its_interface() {
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eth0\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     eth1\t00000000\t0102000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(default_route_interface(table).as_deref(), Some("eth1"));
        assert_eq!(default_route_interface("Iface\tDestination\n"), None);
    }

    #[test]
    fn the_first_ipv4_of_ip_json() -> anyhow::Result<()> {
        let json: serde_json::Value = serde_json::from_str(
            r#"[{"ifname":"eth0","addr_info":[{"family":"inet","local":"192.0.2.2","prefixlen":24}]}]"#,
        )?;
        assert_eq!(first_ipv4(&json), Some(Ipv4Addr::new(192, 0, 2, 2)));
        assert_eq!(first_ipv4(&serde_json::json!([{"addr_info": []}])), None);
        Ok(())
    }

    #[test]
    fn a_dnat_rule_reads_as_iptables_prints_it() {
        let rule = dnat_rule(
            "198.18.1.0/24",
            Ipv4Addr::new(198, 19, 1, 1),
            Ipv4Addr::new(192, 0, 2, 2),
            16444,
        );
        assert_eq!(
            rule.join(" "),
            "PREROUTING -s 198.18.1.0/24 -d 198.19.1.1/32 -p tcp --dport 443 -m comment --comment replicator-e2e \
             -j DNAT --to-destination 192.0.2.2:16444"
        );
        let printed = "PREROUTING -s 198.18.1.0/24 -d 198.19.1.1/32 -p tcp -m tcp --dport 443 -m comment --comment \"replicator e2e\" -j DNAT";
        let words = shell_words(printed);
        assert!(words.contains(&"replicator e2e".to_owned()));
        assert_eq!(words.last().map(String::as_str), Some("DNAT"));
    }

    #[test]
    fn mounts_below_a_directory_come_deepest_first() {
        let mountinfo = "22 1 8:0 / / rw - ext4 /dev/vda rw\n\
                         30 22 8:0 /x /env/nodes/cell-a/kubelet rw - ext4 /dev/vda rw\n\
                         31 30 0:5 / /env/nodes/cell-a/kubelet/pods/u/volumes/a\\040b rw - tmpfs tmpfs rw\n\
                         32 22 0:6 / /environment rw - tmpfs tmpfs rw\n";
        let found = mounts_below(mountinfo, Path::new("/env"));
        assert_eq!(
            found,
            vec![
                PathBuf::from("/env/nodes/cell-a/kubelet/pods/u/volumes/a b"),
                PathBuf::from("/env/nodes/cell-a/kubelet"),
            ]
        );
    }
}
