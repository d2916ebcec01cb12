//! Identity and credentials (issue #15 §4), on the real local control plane, with bare
//! `replicator run` processes (a kill and a restart must be timed precisely):
//!
//! - a replica SIGKILLed and started again with its own identity (as a container restarted in its
//!   pod keeps `$POD_NAME`) finds the Lease still held by itself and writes again within
//!   [`RESUME_BOUND`] of being ready, long before the Lease it left would have expired; the
//!   control, a restart under another identity, waits for that expiry;
//! - a hub kubeconfig whose user names a `tokenFile:` picks up a rotated token without a restart:
//!   the token file is swapped the way the kubelet does (a `..data` symlink), the old token is
//!   revoked (its TokenRequest was bound to a Secret, which is deleted), the 401s met meanwhile
//!   make the process not ready and pause writes, and a source created then reaches the hub
//!   within [`ROTATION_BOUND`].
//!
//! Each scenario uses a namespace, a location and a Lease of its own, and a [`Cleanup`] guard
//! removes what it made (namespaces, copies, Leases, Secrets, files), pass or fail. Waits watch
//! or poll a condition with a deadline; nothing sleeps to synchronise.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Namespace, Secret},
};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use replicator::{election::lease_name, rules::LOCATION_LABEL};
use replicator_e2e::{
    CELL_A, Cluster, Environment, HUB, ReplicatorProcess, ReplicatorSpec, deploy,
    fixtures::{self, unique},
    kubeconfig, metrics, rbac,
    replicator_process::http_get,
    wait::{self, Check},
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// `replicator run`'s default `--lease-duration`, which these scenarios keep.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How soon after a replica restarted under its own identity is ready its writes must resume.
const RESUME_BOUND: Duration = Duration::from_secs(2);
/// How soon after a token file is rotated (and the old token revoked) a new source must reach
/// the hub: kube re-reads a token file at the first request 50 s after it last read it (its
/// cache lives 60 s and is refreshed 10 s early), the hub probe sends a request every second
/// while the hub refuses the old token, a write that met the 401 is retried 5 s later, plus
/// margin.
const ROTATION_BOUND: Duration = Duration::from_secs(75);
/// The latest the old token may be refused, counted from the process start: kube read the token
/// file when the client was built, after the start, and keeps it at least 50 s, so a revocation
/// in force before this leaves the process at least 10 s with a refused token: the 401 window
/// the scenario must see handled. (The hub's authenticator caches a token's success for up to
/// 10 s, so a revocation takes that long to be in force.)
const REVOKE_BEFORE: Duration = Duration::from_secs(40);
/// The fixed interval of the timing polls (readiness), so that a measured figure is off by at
/// most this much.
const TIMING_POLL: Duration = Duration::from_millis(50);

/// What a scenario made, removed when it ends, pass or fail (see the module documentation).
/// Declare it before the processes: they are dropped (killed) first.
struct Cleanup {
    state_dir: PathBuf,
    namespaces: Vec<(Cluster, String)>,
    locations: Vec<String>,
    secrets: Vec<String>,
    paths: Vec<PathBuf>,
    armed: bool,
}

impl Cleanup {
    fn new(env: &Environment) -> Self {
        Self {
            state_dir: env.dir().to_path_buf(),
            namespaces: Vec::new(),
            locations: Vec::new(),
            secrets: Vec::new(),
            paths: Vec::new(),
            armed: true,
        }
    }

    /// Runs the cleanup now and reports its first error.
    async fn finish(mut self, env: &Environment) -> Result<(), String> {
        self.armed = false;
        self.remove(env).await
    }

    async fn remove(&self, env: &Environment) -> Result<(), String> {
        let mut first: Option<String> = None;
        let mut note = |what: &str, result: Result<(), String>| {
            if let Err(error) = result {
                eprintln!("cleanup: {what}: {error}");
                first.get_or_insert(format!("{what}: {error}"));
            }
        };
        for (cluster, name) in &self.namespaces {
            note(
                &format!("namespace {name} in {cluster}"),
                delete_namespace(env, *cluster, name).await,
            );
        }
        let hub = match env.client(HUB).await {
            Ok(hub) => hub,
            Err(error) => return Err(format!("hub client: {error}")),
        };
        for location in &self.locations {
            note(&format!("copies of {location}"), delete_copies(&hub, location).await);
            let leases = Api::<Lease>::namespaced(hub.clone(), rbac::NAMESPACE);
            note(
                &format!("Lease of {location}"),
                delete_opt(&leases, &lease_name(location)).await,
            );
        }
        let secrets = Api::<Secret>::namespaced(hub.clone(), rbac::NAMESPACE);
        for name in &self.secrets {
            note(&format!("Secret {name}"), delete_opt(&secrets, name).await);
        }
        for path in &self.paths {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(path)
            } else {
                std::fs::remove_file(path)
            };
            match removed {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => note(&format!("removing {}", path.display()), Err(error.to_string())),
            }
            // Its parent too, once empty (another scenario's files keep it).
            if let Some(parent) = path.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
        for (cluster, name) in &self.namespaces {
            note(
                &format!("namespace {name} in {cluster} gone"),
                namespace_gone(env, *cluster, name).await,
            );
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        let this = Cleanup {
            state_dir: self.state_dir.clone(),
            namespaces: std::mem::take(&mut self.namespaces),
            locations: std::mem::take(&mut self.locations),
            secrets: std::mem::take(&mut self.secrets),
            paths: std::mem::take(&mut self.paths),
            armed: false,
        };
        // Drop cannot await, and the test's runtime may be unwinding: a thread with a runtime of
        // its own does the work.
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let env = Environment::attach(&this.state_dir).await.map_err(|e| e.to_string())?;
                this.remove(&env).await
            })
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("cleanup after a failure failed: {error}"),
            Err(_) => eprintln!("cleanup after a failure panicked"),
        }
    }
}

async fn delete_opt<K>(api: &Api<K>, name: &str) -> Result<(), String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

async fn delete_namespace(env: &Environment, cluster: Cluster, name: &str) -> Result<(), String> {
    let api = Api::<Namespace>::all(env.client(cluster).await.map_err(|e| e.to_string())?);
    delete_opt(&api, name).await
}

async fn namespace_gone(env: &Environment, cluster: Cluster, name: &str) -> Result<(), String> {
    let api = Api::<Namespace>::all(env.client(cluster).await.map_err(|e| e.to_string())?);
    wait::until(
        Duration::from_secs(60),
        &format!("namespace {name} gone from {cluster}"),
        || {
            let api = api.clone();
            async move { Ok::<_, kube::Error>(api.get_opt(name).await?.is_none().then_some(())) }
        },
    )
    .await
    .map_err(|e| e.to_string())
}

/// Deletes every copy `location` published on the hub, of every default kind (a bare replicator
/// mirrors the whole cell, so copies of other namespaces' sources too).
async fn delete_copies(hub: &Client, location: &str) -> Result<(), String> {
    for rule in replicator::rules::default_rules() {
        let resource = rule.resource.api_resource();
        let api = Api::<DynamicObject>::all_with(hub.clone(), &resource);
        let list = api
            .list(&ListParams::default().labels(&format!("{LOCATION_LABEL}={location}")))
            .await
            .map_err(|e| e.to_string())?;
        for copy in list.items {
            let Some(namespace) = copy.namespace() else { continue };
            let namespaced = Api::<DynamicObject>::namespaced_with(hub.clone(), &namespace, &resource);
            delete_opt(&namespaced, &copy.name_any()).await?;
        }
    }
    Ok(())
}

/// Spawns a replicator and waits until it leads `location`.
async fn start_leading(env: &Environment, spec: ReplicatorSpec, location: &str) -> ReplicatorProcess {
    let mut p = ReplicatorProcess::spawn(env, spec).await.unwrap();
    p.wait_ready(Duration::from_secs(60)).await.unwrap();
    leads(&p, location, Duration::from_secs(30)).await;
    p
}

/// Waits until `p` reports `replicator_leader 1` for `location`.
async fn leads(p: &ReplicatorProcess, location: &str, deadline: Duration) {
    wait::until(deadline, &format!("{} to lead {location}", p.identity()), || async {
        let gauge = p.metric("replicator_leader", &[("location", location)]).await?;
        Ok::<_, replicator_e2e::Error>((gauge == Some(1.0)).then_some(()))
    })
    .await
    .unwrap();
}

/// Polls `/readyz` of `p` every [`TIMING_POLL`] until it answers 200; returns when it first did.
async fn ready_at(p: &mut ReplicatorProcess, deadline: Duration) -> Instant {
    let url = format!("{}/readyz", p.health_url());
    let end = Instant::now() + deadline;
    loop {
        if let Some(status) = p.try_exit_status().unwrap() {
            panic!(
                "{} exited with {status} before it was ready:\n{}",
                p.identity(),
                p.log_tail(40)
            );
        }
        let last = match http_get(&url).await {
            Ok((200, _)) => return Instant::now(),
            Ok((code, body)) => format!("HTTP {code}: {}", body.trim()),
            Err(error) => error.to_string(),
        };
        assert!(
            Instant::now() < end,
            "{} not ready within {deadline:?}: {last}",
            p.identity()
        );
        tokio::time::sleep(TIMING_POLL).await;
    }
}

/// Watches the hub for the copy `ns/name` (in a task, started before whatever writes it) and
/// returns when it was first seen, on the monotonic and the wall clock. A copy already there
/// when the watch lists counts as seen then.
fn copy_seen(hub: &Client, ni: &ApiResource, ns: &str, name: &str) -> tokio::task::JoinHandle<(Instant, SystemTime)> {
    let api = Api::<DynamicObject>::namespaced_with(hub.clone(), ns, ni);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    tokio::spawn(async move {
        let mut objects = watcher::watcher(api, config).applied_objects().boxed();
        loop {
            match objects.next().await {
                Some(Ok(_)) => return (Instant::now(), SystemTime::now()),
                // A failed watch is retried by the watcher (the deadline is the caller's).
                Some(Err(error)) => eprintln!("copy watch: {error}"),
                None => panic!("the copy watch ended"),
            }
        }
    })
}

/// The Lease of `location`: holder, renew time and duration, transitions.
struct LeaseView {
    holder: String,
    renewed: SystemTime,
    duration: Duration,
    transitions: i32,
}

impl LeaseView {
    /// When the term that was renewed last ends, if nobody renews it.
    fn expiry(&self) -> SystemTime {
        self.renewed + self.duration
    }
}

async fn lease(hub: &Client, location: &str) -> LeaseView {
    let lease = Api::<Lease>::namespaced(hub.clone(), rbac::NAMESPACE)
        .get(&lease_name(location))
        .await
        .unwrap();
    let spec = lease.spec.unwrap_or_default();
    LeaseView {
        holder: spec.holder_identity.unwrap_or_default(),
        renewed: spec
            .renew_time
            .map(|t| SystemTime::from(t.0))
            .unwrap_or(SystemTime::UNIX_EPOCH),
        duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or_default().try_into().unwrap()),
        transitions: spec.lease_transitions.unwrap_or_default(),
    }
}

/// What a kill and restart measured.
struct Restart {
    /// The Lease as the killed replica left it.
    left: LeaseView,
    /// The Lease once the restarted replica wrote.
    after: LeaseView,
    /// The restarted process: spawned, first ready, first new copy seen on the hub.
    spawned: Instant,
    ready: Instant,
    copied: Instant,
    /// The wall-clock time the new copy was seen.
    copied_at: SystemTime,
}

/// Starts a replica of `location` on cell-a with identity `first`, SIGKILLs it right after it
/// renewed its Lease (so the term it leaves runs its full [`LEASE_DURATION`]), creates a source
/// and starts a replica with identity `second`; measures when it is ready and when the source's
/// copy reaches the hub (within `deadline` of the start).
async fn kill_and_restart(
    env: &Environment,
    ns: &str,
    location: &str,
    first: &str,
    second: &str,
    deadline: Duration,
) -> Restart {
    let (cell, hub) = (env.client(CELL_A).await.unwrap(), env.client(HUB).await.unwrap());
    let ni = fixtures::resource("networkinterfaces").unwrap();
    let spec = |identity: &str| ReplicatorSpec::new(CELL_A).location(location).identity(identity);
    let mut old = start_leading(env, spec(first), location).await;
    let object = |name: &str| fixtures::network_interface(ns, name, "default", name, "web", location);
    fixtures::apply(&cell, &ni, &object("before")).await.unwrap();
    let before = replicator::copy::copy_name(ns, "before", location);
    fixtures::wait_for(&hub, &ni, ns, &before, fixtures::CONVERGE, "the first copy", |_| true)
        .await
        .unwrap();

    // Killed right after a renewal: the term it leaves is a full Lease duration.
    let seen = lease(&hub, location).await;
    assert_eq!(seen.holder, first, "the first replica holds the Lease");
    assert_eq!(seen.duration, LEASE_DURATION);
    wait::until(LEASE_DURATION, "the leader to renew its Lease", || async {
        Ok::<_, String>((lease(&hub, location).await.renewed > seen.renewed).then_some(()))
    })
    .await
    .unwrap();
    old.kill().await.unwrap();
    let left = lease(&hub, location).await;
    assert_eq!(left.holder, first, "a SIGKILLed leader does not release its Lease");

    // A source created right after the kill: nobody writes its copy until a replica leads.
    fixtures::apply(&cell, &ni, &object("after-kill")).await.unwrap();
    let copy = replicator::copy::copy_name(ns, "after-kill", location);
    let seen = copy_seen(&hub, &ni, ns, &copy);
    let spawned = Instant::now();
    let mut new = ReplicatorProcess::spawn(env, spec(second)).await.unwrap();
    let ready = ready_at(&mut new, Duration::from_secs(60)).await;
    let (copied, copied_at) = match tokio::time::timeout(deadline.saturating_sub(spawned.elapsed()), seen).await {
        Ok(seen) => seen.unwrap(),
        Err(_) => panic!(
            "the copy {ns}/{copy} did not reach the hub within {deadline:?} of the restart; its log:\n{}",
            new.log_tail(40)
        ),
    };
    leads(&new, location, Duration::from_secs(5)).await;
    let after = lease(&hub, location).await;
    new.kill().await.unwrap();
    Restart {
        left,
        after,
        spawned,
        ready,
        copied,
        copied_at,
    }
}

/// Seconds from `earlier` to `later`, negative when `later` came first.
fn secs_between(earlier: SystemTime, later: SystemTime) -> f64 {
    match later.duration_since(earlier) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

#[tokio::test]
async fn a_replica_restarted_with_its_own_identity_resumes_its_lease_at_once() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, location) = (unique("identity"), unique("loc"));
    let mut cleanup = Cleanup::new(&env);
    cleanup.namespaces.extend([(HUB, ns.clone()), (CELL_A, ns.clone())]);
    cleanup.locations.push(location.clone());
    deploy::routed_namespace(&env, &[HUB, CELL_A], &ns).await?;
    let replica = format!("{location}-replica-0");

    let r = kill_and_restart(&env, &ns, &location, &replica, &replica, Duration::from_secs(30)).await;
    let to_ready = r.ready.duration_since(r.spawned);
    let after_ready = r.copied.saturating_duration_since(r.ready);
    eprintln!(
        "restarted as itself: ready {:.2}s after the start, first new copy on the hub {:.2}s after the start, {:.2}s after ready; the old term had {:.1}s left",
        to_ready.as_secs_f64(),
        r.copied.duration_since(r.spawned).as_secs_f64(),
        after_ready.as_secs_f64(),
        secs_between(r.copied_at, r.left.expiry()),
    );
    assert!(
        after_ready <= RESUME_BOUND,
        "writes resume within {RESUME_BOUND:?} of the restart being ready: {after_ready:?}"
    );
    assert!(
        r.copied_at < r.left.expiry(),
        "the copy was written under the Lease the replica left ({:.1}s before it would have expired), not after it expired",
        secs_between(r.copied_at, r.left.expiry())
    );
    assert_eq!(r.after.holder, replica, "the restarted replica holds its Lease");
    assert_eq!(
        r.after.transitions, r.left.transitions,
        "resuming its own Lease is no transition"
    );
    cleanup.finish(&env).await?;
    Ok(())
}

#[tokio::test]
async fn a_replica_restarted_under_another_identity_waits_for_the_lease_to_expire() -> TestResult {
    // The control of the scenario above: the same kill and restart, but the new process is
    // another replica, so the Lease the killed one left must run out first.
    let env = Environment::ensure_up().await?;
    let (ns, location) = (unique("identity"), unique("loc"));
    let mut cleanup = Cleanup::new(&env);
    cleanup.namespaces.extend([(HUB, ns.clone()), (CELL_A, ns.clone())]);
    cleanup.locations.push(location.clone());
    deploy::routed_namespace(&env, &[HUB, CELL_A], &ns).await?;
    let (first, second) = (format!("{location}-replica-0"), format!("{location}-replica-1"));

    let r = kill_and_restart(&env, &ns, &location, &first, &second, LEASE_DURATION * 4).await;
    let after_ready = r.copied.saturating_duration_since(r.ready);
    eprintln!(
        "restarted as another replica: ready {:.2}s after the start, first new copy on the hub {:.2}s after the start, {:.2}s after ready, {:.2}s after the old term expired",
        r.ready.duration_since(r.spawned).as_secs_f64(),
        r.copied.duration_since(r.spawned).as_secs_f64(),
        after_ready.as_secs_f64(),
        secs_between(r.left.expiry(), r.copied_at),
    );
    assert!(
        r.copied_at >= r.left.expiry(),
        "nobody writes until the Lease the killed replica left expires: the copy came {:.1}s before",
        secs_between(r.copied_at, r.left.expiry())
    );
    assert!(
        after_ready > RESUME_BOUND,
        "another identity does not resume within {RESUME_BOUND:?} of being ready: {after_ready:?}"
    );
    assert_eq!(r.after.holder, second, "the new replica took the Lease over");
    assert_eq!(
        r.after.transitions,
        r.left.transitions + 1,
        "a takeover is a transition"
    );
    cleanup.finish(&env).await?;
    Ok(())
}

/// A token of the hub identity of `location` (service account `replicator-<location>` in
/// [`rbac::NAMESPACE`], which must exist) bound to Secret `anchor` (in the same namespace):
/// deleting the Secret revokes the token.
async fn bound_token(env: &Environment, location: &str, anchor: &str) -> String {
    let secrets = Api::<Secret>::namespaced(env.client(HUB).await.unwrap(), rbac::NAMESPACE);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(anchor.to_owned()),
            ..ObjectMeta::default()
        },
        ..Secret::default()
    };
    secrets.create(&PostParams::default(), &secret).await.unwrap();
    let account = rbac::hub_service_account(location);
    env.kubectl_ok(
        HUB,
        [
            "-n",
            rbac::NAMESPACE,
            "create",
            "token",
            &account,
            "--bound-object-kind=Secret",
            &format!("--bound-object-name={anchor}"),
            "--duration=1h",
        ],
    )
    .await
    .unwrap()
    .trim()
    .to_owned()
}

/// What the hub answers to `/version` with `token`: its HTTP status (no client of the product:
/// a plain request).
async fn status_with_token(env: &Environment, token: &str) -> u16 {
    let ca = env.pki().ca_pem().await.unwrap();
    let http = reqwest::Client::builder()
        .no_proxy()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    http.get(format!("{}/version", env.server_url(HUB)))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Requests `p` sent to the hub that were answered 401, by every verb and resource.
async fn hub_401s(p: &ReplicatorProcess) -> f64 {
    metrics::parse(&p.scrape_metrics().await.unwrap())
        .iter()
        .filter(|s| {
            s.name == "replicator_api_requests_total"
                && s.label("cluster") == Some("hub")
                && s.label("code") == Some("401")
        })
        .map(|s| s.value)
        .sum()
}

#[tokio::test]
async fn a_rotated_token_file_is_picked_up_and_a_revoked_token_only_pauses_writes() -> TestResult {
    let env = Environment::ensure_up().await?;
    let (ns, location) = (unique("tokenfile"), unique("loc"));
    // The location's hub identity, whose tokens the scenario issues itself.
    env.least_privilege().await?.hub_kubeconfig_for(&env, &location).await?;
    let dir = env.dir().join("identity").join(&location);
    let (anchor_old, anchor_new) = (format!("{location}-token-1"), format!("{location}-token-2"));
    let mut cleanup = Cleanup::new(&env);
    cleanup.namespaces.extend([(HUB, ns.clone()), (CELL_A, ns.clone())]);
    cleanup.locations.push(location.clone());
    cleanup.secrets.extend([anchor_old.clone(), anchor_new.clone()]);
    cleanup.paths.push(dir.clone());
    deploy::routed_namespace(&env, &[HUB, CELL_A], &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let ni = fixtures::resource("networkinterfaces")?;

    // The token file as a kubelet mounts it, named by the kubeconfig's `tokenFile:`.
    let (old_token, new_token) = (
        bound_token(&env, &location, &anchor_old).await,
        bound_token(&env, &location, &anchor_new).await,
    );
    assert_eq!(status_with_token(&env, &old_token).await, 200);
    let tokens = dir.join("token");
    kubeconfig::publish_atomically(&tokens, "token", "1", old_token.as_bytes())?;
    let hub_kubeconfig = dir.join("hub.kubeconfig");
    kubeconfig::write_token_file_kubeconfig(&env, HUB, &tokens.join("token"), &hub_kubeconfig).await?;

    let spawned = Instant::now();
    let spec = ReplicatorSpec::new(CELL_A)
        .location(&location)
        .hub_kubeconfig(&hub_kubeconfig);
    let mut p = start_leading(&env, spec, &location).await;
    let object = |name: &str| fixtures::network_interface(&ns, name, "default", name, "web", &location);
    fixtures::apply(&cell, &ni, &object("before")).await?;
    let before = replicator::copy::copy_name(&ns, "before", &location);
    fixtures::wait_for(&hub, &ni, &ns, &before, fixtures::CONVERGE, "the first copy", |_| true).await?;
    assert_eq!(hub_401s(&p).await, 0.0, "no 401 before the rotation");

    // Rotate as the kubelet does, then revoke the old token (its Secret goes).
    kubeconfig::publish_atomically(&tokens, "token", "2", new_token.as_bytes())?;
    let rotated = Instant::now();
    let secrets = Api::<Secret>::namespaced(hub.clone(), rbac::NAMESPACE);
    delete_opt(&secrets, &anchor_old).await?;
    wait::until(Duration::from_secs(30), "the old token to be refused", || async {
        Ok::<_, String>((status_with_token(&env, &old_token).await == 401).then_some(()))
    })
    .await?;
    eprintln!(
        "old token refused {:.1}s after the start",
        spawned.elapsed().as_secs_f64()
    );
    let refused_after = spawned.elapsed();
    assert!(
        refused_after < REVOKE_BEFORE,
        "the old token was refused only {refused_after:?} after the start: the process may have re-read the file already, leaving no window of 401s to check"
    );

    // A source created now meets the revoked token: the hub answers 401, the process says so
    // and pauses, and neither exits nor gives up.
    let copy = replicator::copy::copy_name(&ns, "after-rotation", &location);
    let seen = copy_seen(&hub, &ni, &ns, &copy);
    fixtures::apply(&cell, &ni, &object("after-rotation")).await?;
    let url = format!("{}/readyz", p.health_url());
    let refused = wait::until_observed(Duration::from_secs(30), "readiness to report the 401", || async {
        let (code, body) = http_get(&url).await?;
        Ok::<_, replicator_e2e::Error>(
            if code == 503 && body.contains("credentials rejected (401 Unauthorized)") {
                Check::Ready(body)
            } else {
                Check::NotYet(format!("HTTP {code}: {}", body.trim()))
            },
        )
    })
    .await?;
    eprintln!(
        "{:.1}s after the rotation /readyz says: {}",
        rotated.elapsed().as_secs_f64(),
        refused.trim()
    );

    let (copied, _) = match tokio::time::timeout(ROTATION_BOUND.saturating_sub(rotated.elapsed()), seen).await {
        Ok(seen) => seen?,
        Err(_) => panic!(
            "the copy {ns}/{copy} did not reach the hub within {ROTATION_BOUND:?} of the rotation; log:\n{}",
            p.log_tail(40)
        ),
    };
    eprintln!(
        "the source created after the rotation reached the hub {:.1}s after it ({:.1}s after the start)",
        copied.duration_since(rotated).as_secs_f64(),
        copied.duration_since(spawned).as_secs_f64()
    );
    assert!(
        p.try_exit_status()?.is_none(),
        "a 401 is not fatal: the process runs on"
    );
    let refusals = hub_401s(&p).await;
    assert!(refusals >= 1.0, "the hub answered the revoked token 401: {refusals}");
    p.wait_ready(Duration::from_secs(30)).await?;
    leads(&p, &location, Duration::from_secs(30)).await;
    // Still on the new token: the old one stays refused.
    assert_eq!(status_with_token(&env, &old_token).await, 401);
    assert_eq!(status_with_token(&env, &new_token).await, 200);
    p.terminate(Duration::from_secs(20)).await?;
    drop(p);
    cleanup.finish(&env).await?;
    Ok(())
}
