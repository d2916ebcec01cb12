//! The load: galactic EndpointSlices and NetworkInterfaces in two cells, created, updated and
//! deleted at a steady rate.
//!
//! The population is spread evenly over four targets (cell-a/dfw and cell-b/sjc × the two
//! kinds). Every create and update carries a fresh sequence number in [`SEQ_LABEL`], a
//! `compute.datumapis.com/` label, which the default rules carry to the copy for both kinds (all
//! labels of a galactic slice, the `compute.datumapis.com/*` labels of an interface), so the
//! relay and the replicator are measured on the same field. Churn cycles update, create,
//! update, delete: the population stays constant; creates use fresh names, deletes take the
//! oldest object, updates a random one, and an object is never written twice at once.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use rand::Rng as _;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::lag::{Ack, Op, Recorder};
use crate::fixtures;
use crate::{Cluster, Environment};

/// The label carrying the sequence number of the last write (mirrored for both kinds).
pub const SEQ_LABEL: &str = "compute.datumapis.com/bench-seq";
/// The label marking the sources of one bench run (value: the run id), for clean-up.
pub const RUN_LABEL: &str = "replicator-bench.datumapis.com/run";
/// Most cell writes in flight at once; past it the generator falls behind its rate (the
/// achieved rate is reported).
const MAX_IN_FLIGHT: usize = 64;

/// The mirrored kinds under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A galactic per-pod EndpointSlice.
    Slice,
    /// A NetworkInterface.
    Interface,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Slice => "es",
            Kind::Interface => "ni",
        }
    }
}

/// One place objects are written: a cell (with its location) and a kind.
#[derive(Clone)]
struct Target {
    location: &'static str,
    kind: Kind,
    api: Api<DynamicObject>,
}

#[derive(Debug, Clone)]
struct Object {
    target: usize,
    name: String,
}

#[derive(Default)]
struct Population {
    objects: Vec<Object>,
    live: VecDeque<usize>,
    busy: HashSet<usize>,
}

/// What one churn window did.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChurnStats {
    /// The rate asked for (writes per second).
    pub rate: f64,
    /// Writes acknowledged by a cell.
    pub acked: usize,
    /// Writes that failed.
    pub failed: usize,
    /// Wall time of the window, until the last write was answered.
    pub elapsed: Duration,
}

impl ChurnStats {
    /// Acknowledged writes per second.
    pub fn achieved(&self) -> f64 {
        self.acked as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The load generator of one namespace. Cheap to share behind an [`Arc`].
pub struct Load {
    namespace: String,
    run: String,
    targets: Vec<Target>,
    population: Mutex<Population>,
    seq: AtomicU64,
    next_index: AtomicUsize,
    /// Labels every created source carries besides the sequence and run labels.
    source_labels: Vec<(String, String)>,
    /// The location a mirror publishes the copies of a cell's sources under, from the cell's
    /// (the cell's own for the replicator; [`super::relay::hub_location`] for the relay).
    copy_location: fn(&str) -> String,
}

/// The replicator's copies: published under the cell's own location.
fn cell_location(location: &str) -> String {
    location.to_owned()
}

fn lock(m: &Mutex<Population>) -> MutexGuard<'_, Population> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Load {
    /// A generator writing into `namespace` of both cells; `run` tags the sources for clean-up.
    ///
    /// # Errors
    /// When a cell client cannot be built.
    pub async fn new(env: &Environment, namespace: &str, run: &str) -> anyhow::Result<Load> {
        let [slices, interfaces] = super::lag::churned_kinds()?;
        let mut targets = Vec::new();
        for cell in Cluster::CELLS {
            let client = env.client(cell).await?;
            let location = cell.location().context("a cell without a location")?;
            for (kind, resource) in [(Kind::Slice, &slices), (Kind::Interface, &interfaces)] {
                targets.push(Target {
                    location,
                    kind,
                    api: Api::namespaced_with(client.clone(), namespace, resource),
                });
            }
        }
        Ok(Load {
            namespace: namespace.to_owned(),
            run: run.to_owned(),
            targets,
            population: Mutex::default(),
            seq: AtomicU64::new(1),
            next_index: AtomicUsize::new(0),
            source_labels: Vec::new(),
            copy_location: cell_location,
        })
    }

    /// The same generator, with `key=value` on every source it creates (the relay's sources
    /// carry the replicator's loop-guard label, so the replicator never sees them).
    #[must_use]
    pub fn with_source_label(mut self, key: &str, value: &str) -> Self {
        self.source_labels.push((key.to_owned(), value.to_owned()));
        self
    }

    /// The same generator, for a mirror that publishes the copies of a cell's sources under
    /// `location(<the cell's location>)` (the relay: [`super::relay::hub_location`]): the copy
    /// names it expects on the hub.
    #[must_use]
    pub fn with_copy_location(mut self, location: fn(&str) -> String) -> Self {
        self.copy_location = location;
        self
    }

    /// How many objects exist now.
    pub fn population(&self) -> usize {
        lock(&self.population).live.len()
    }

    /// How many objects exist now in the cell of `location`.
    pub fn population_of(&self, location: &str) -> usize {
        let population = lock(&self.population);
        population
            .live
            .iter()
            .filter(|id| self.targets[population.objects[**id].target].location == location)
            .count()
    }

    /// The copy name of object `name` published from `location` (`<name>-<location>`).
    pub fn copy_name(name: &str, location: &str) -> String {
        format!("{name}-{location}")
    }

    fn body(&self, target: &Target, name: &str, seq: u64) -> Value {
        let ns = &self.namespace;
        let mut object = match target.kind {
            Kind::Slice => {
                let index = name.trim_start_matches(|c: char| !c.is_ascii_digit());
                let index: u32 = index.parse().unwrap_or_default();
                let address =
                    std::net::Ipv6Addr::new(0xfd20, 0, (index >> 16) as u16, (index & 0xffff) as u16, 0, 0, 0, 0x10)
                        .to_string();
                fixtures::galactic_slice(
                    ns,
                    name,
                    json!([fixtures::pod_endpoint(&address, name)]),
                    Some("fc00:0:1:e000::"),
                )
            }
            Kind::Interface => {
                fixtures::network_interface(ns, name, "default", &format!("{name}-claim"), "bench", target.location)
            }
        };
        object["metadata"]["labels"][SEQ_LABEL] = json!(seq.to_string());
        object["metadata"]["labels"][RUN_LABEL] = json!(self.run);
        for (key, value) in &self.source_labels {
            object["metadata"]["labels"][key] = json!(value);
        }
        object
    }

    /// Creates `count` objects spread over the four targets, `MAX_IN_FLIGHT` at a time.
    ///
    /// # Errors
    /// The first failed create.
    pub async fn populate(&self, count: usize) -> anyhow::Result<()> {
        let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..count {
            let permit = Arc::clone(&in_flight).acquire_owned().await?;
            let (id, target, body) = self.new_object();
            tasks.spawn(async move {
                let result = target
                    .api
                    .create(&PostParams::default(), &serde_json::from_value(body)?)
                    .await;
                drop(permit);
                result.with_context(|| format!("creating {} in {}", target.api.resource_url(), target.location))?;
                Ok::<_, anyhow::Error>(id)
            });
            while let Some(done) = tasks.try_join_next() {
                self.created(done??);
            }
        }
        while let Some(done) = tasks.join_next().await {
            self.created(done??);
        }
        Ok(())
    }

    fn created(&self, id: usize) {
        let mut population = lock(&self.population);
        population.busy.remove(&id);
        population.live.push_back(id);
    }

    /// Registers a new object (round-robin over targets) and returns its id, target and body.
    fn new_object(&self) -> (usize, Target, Value) {
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        let target_index = index % self.targets.len();
        let target = self.targets[target_index].clone();
        let name = format!("{}-{index:06}", target.kind.prefix());
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let body = self.body(&target, &name, seq);
        let mut population = lock(&self.population);
        let id = population.objects.len();
        population.objects.push(Object {
            target: target_index,
            name,
        });
        population.busy.insert(id);
        (id, target, body)
    }

    /// Writes at `rate` per second for `duration` (cycle: update, create, update, delete),
    /// reporting every acknowledged write to `recorder` under `window`.
    ///
    /// # Errors
    /// Only when the semaphore closes (never); failed writes are counted, not fatal.
    pub async fn churn(
        self: &Arc<Self>,
        rate: f64,
        duration: Duration,
        recorder: &Recorder,
        window: usize,
    ) -> anyhow::Result<ChurnStats> {
        let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let acked = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        let started = Instant::now();
        let mut step = 0usize;
        while started.elapsed() < duration {
            tick.tick().await;
            let permit = Arc::clone(&in_flight).acquire_owned().await?;
            let op = match step % 4 {
                1 => Op::Create,
                3 => Op::Delete,
                _ => Op::Update,
            };
            step += 1;
            let Some(write) = self.pick(op) else { continue };
            let (this, recorder, acked, failed) = (
                Arc::clone(self),
                recorder.clone(),
                Arc::clone(&acked),
                Arc::clone(&failed),
            );
            tasks.spawn(async move {
                let result = this.execute(&write).await;
                let at = Instant::now();
                drop(permit);
                this.finish(&write, result.is_ok());
                match result {
                    Ok(()) => {
                        acked.fetch_add(1, Ordering::Relaxed);
                        recorder.ack(Ack {
                            window,
                            copy: Load::copy_name(&write.name, &(this.copy_location)(write.target.location)),
                            seq: write.seq,
                            op: write.op,
                            at,
                        });
                    }
                    Err(error) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%error, "cell write failed");
                    }
                }
            });
            while tasks.try_join_next().is_some() {}
        }
        while tasks.join_next().await.is_some() {}
        Ok(ChurnStats {
            rate,
            acked: acked.load(Ordering::Relaxed),
            failed: failed.load(Ordering::Relaxed),
            elapsed: started.elapsed(),
        })
    }

    /// Chooses the object of the next write and marks it busy.
    fn pick(&self, op: Op) -> Option<Write> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        if op == Op::Create {
            let (id, target, body) = self.new_object();
            let name = lock(&self.population).objects[id].name.clone();
            return Some(Write {
                id,
                op,
                seq,
                target,
                name,
                body: Some(body),
            });
        }
        let mut population = lock(&self.population);
        let live = population.live.len();
        if live == 0 {
            return None;
        }
        let position = match op {
            // The oldest object that is not being written.
            Op::Delete => (0..live.min(64)).find(|&i| !population.busy.contains(&population.live[i]))?,
            _ => {
                let mut rng = rand::rng();
                (0..16)
                    .map(|_| rng.random_range(0..live))
                    .find(|&i| !population.busy.contains(&population.live[i]))?
            }
        };
        let id = population.live[position];
        if op == Op::Delete {
            population.live.remove(position);
        }
        population.busy.insert(id);
        let object = population.objects[id].clone();
        Some(Write {
            id,
            op,
            seq,
            target: self.targets[object.target].clone(),
            name: object.name,
            body: None,
        })
    }

    async fn execute(&self, write: &Write) -> Result<(), kube::Error> {
        let api = &write.target.api;
        match write.op {
            Op::Create => {
                let mut body = write.body.clone().unwrap_or_default();
                body["metadata"]["labels"][SEQ_LABEL] = json!(write.seq.to_string());
                let object: DynamicObject = serde_json::from_value(body).map_err(kube::Error::SerdeError)?;
                api.create(&PostParams::default(), &object).await.map(drop)
            }
            Op::Update => {
                let patch = json!({"metadata": {"labels": {SEQ_LABEL: write.seq.to_string()}}});
                api.patch(&write.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(drop)
            }
            Op::Delete => api.delete(&write.name, &DeleteParams::default()).await.map(drop),
        }
    }

    fn finish(&self, write: &Write, ok: bool) {
        let mut population = lock(&self.population);
        population.busy.remove(&write.id);
        match (write.op, ok) {
            (Op::Create, true) => population.live.push_back(write.id),
            // A failed delete leaves the object in place: it stays in the population.
            (Op::Delete, false) => population.live.push_back(write.id),
            _ => {}
        }
    }

    /// Deletes every source of this run from both cells (a collection delete per target).
    ///
    /// # Errors
    /// The first failed delete.
    pub async fn delete_all(&self) -> anyhow::Result<()> {
        let selector = ListParams::default().labels(&format!("{RUN_LABEL}={}", self.run));
        for target in &self.targets {
            let delete_params = DeleteParams::default();
            super::retrying(|| target.api.delete_collection(&delete_params, &selector)).await?;
        }
        let mut population = lock(&self.population);
        population.live.clear();
        population.busy.clear();
        Ok(())
    }

    /// The namespace written into.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

/// One write in flight.
struct Write {
    id: usize,
    op: Op,
    seq: u64,
    target: Target,
    name: String,
    body: Option<Value>,
}

/// The API resources of the two kinds, for callers that list or delete copies.
pub fn resources() -> anyhow::Result<[ApiResource; 2]> {
    super::lag::churned_kinds()
}
