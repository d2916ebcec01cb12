//! The wiring of `replicator run`: clients, metrics and probes; per cell its mirror, election,
//! outage probe and sweep; per hub kubeconfig its health prober and kubeconfig watch.

use std::{path::PathBuf, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::{
    cluster::{self, HubHealth},
    election,
    health::Health,
    http, kubeconfig_watch,
    metrics::{ErrorLabels, LocationLabels, Metrics},
    outage, rules,
    runtime::spawn_signal_handler,
    sweep,
    sync::{CellSync, Settings},
};

use super::{RunArgs, cells};

/// Runs `replicator run` until SIGTERM or SIGINT: for each cell, reflectors, queue and writers
/// (gated by the location's Lease), the sweep and the reachability probe; per hub kubeconfig
/// (one, or one per location with `--cell-hub-kubeconfig`): the hub client, its health prober
/// and the kubeconfig watch; shared: metrics and probes.
///
/// # Errors
/// Invalid flags or rules, a cell client that cannot be built, or an unbindable address.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let cells = cells(&args)?;
    if args.leader_elect {
        election::check_timing(args.lease_duration, args.lease_grace).map_err(anyhow::Error::msg)?;
    }
    let rules = rules::load(args.rules.as_deref())?;
    let cancel = CancellationToken::new();
    spawn_signal_handler(cancel.clone());

    let mut registry = Registry::default();
    crate::metrics::register_process(&mut registry);
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::default();
    let mut groups: Vec<HubGroup> = Vec::new();
    for cell in cells {
        metrics
            .hub_up
            .get_or_create(&LocationLabels {
                location: cell.location.clone(),
            })
            .set(0);
        metrics
            .leader
            .get_or_create(&LocationLabels {
                location: cell.location.clone(),
            })
            .set(0);
        let client = cluster::cell_client(cell.cell_kubeconfig.as_deref())
            .await
            .map_err(|err| anyhow::anyhow!("cell {}: {err}", cell.location))?;
        match groups.iter_mut().find(|g| g.kubeconfig == cell.hub_kubeconfig) {
            Some(group) => group.cells.push((cell.location, client, cell.outage)),
            None => groups.push(HubGroup {
                kubeconfig: cell.hub_kubeconfig,
                cells: vec![(cell.location, client, cell.outage)],
            }),
        }
    }
    let single = groups.len() == 1;
    for group in &groups {
        health.set(
            &group.health_key(single),
            format!("waiting for hub kubeconfig {}", group.kubeconfig.display()),
        );
    }

    let mut servers = http::spawn(&args.serve, registry, health.clone(), &cancel);
    let args = Arc::new(args);
    let identity = args.identity.clone().unwrap_or_else(election::default_identity);
    let shared = Arc::new(Shared {
        args,
        identity,
        rules,
        metrics,
        health,
        cancel: cancel.clone(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for group in groups {
        let key = group.health_key(single);
        tasks.spawn(serve_hub(group, key, Arc::clone(&shared)));
    }

    let mut result = Ok(());
    tokio::select! {
        () = cancel.cancelled() => {}
        Some(served) = servers.join_next() => {
            if let Ok(Err(err)) = served {
                result = Err(err.into());
            }
            cancel.cancel();
        }
    }
    while tasks.join_next().await.is_some() {}
    while servers.join_next().await.is_some() {}
    tracing::info!("stopped");
    result
}

/// What every hub group of a `replicator run` process shares.
struct Shared {
    args: Arc<RunArgs>,
    /// This replica's identity in the Leases.
    identity: String,
    rules: Vec<rules::Rule>,
    metrics: Metrics,
    health: Health,
    cancel: CancellationToken,
}

/// The cells that reach the hub through one hub kubeconfig.
struct HubGroup {
    kubeconfig: PathBuf,
    cells: Vec<(String, kube::Client, outage::Policy)>,
}

impl HubGroup {
    /// Its component in readiness: `hub` when the process has one hub kubeconfig, else
    /// `hub <locations>`.
    fn health_key(&self, single: bool) -> String {
        if single {
            "hub".to_owned()
        } else {
            let locations: Vec<&str> = self.cells.iter().map(|(l, _, _)| l.as_str()).collect();
            format!("hub {}", locations.join(","))
        }
    }
}

/// Serves the cells of `group` once its hub kubeconfig yields a client: the hub health prober
/// and kubeconfig watch of that kubeconfig, then for each cell its election, sync, outage
/// policy and sweep. Returns when `cancel` fires (or at once if it fires before the hub
/// kubeconfig is usable).
async fn serve_hub(group: HubGroup, key: String, shared: Arc<Shared>) {
    let Shared {
        args,
        identity,
        rules,
        metrics,
        health,
        cancel,
    } = &*shared;
    let hub = cluster::wait_for_hub_client(&group.kubeconfig, Duration::from_secs(2), cancel, health, &key).await;
    let Some(cluster::Hub {
        client: hub,
        server,
        kubeconfig,
    }) = hub
    else {
        return;
    };
    health.set(&key, format!("connecting to {server}"));
    tracing::info!(
        locations = ?group.cells.iter().map(|(l, _, _)| l.as_str()).collect::<Vec<_>>(),
        rules = rules.len(),
        leader_elect = args.leader_elect,
        identity = %identity,
        server = %server,
        kubeconfig = %group.kubeconfig.display(),
        "hub kubeconfig loaded; starting"
    );
    let locations: Vec<LocationLabels> = group
        .cells
        .iter()
        .map(|(location, _, _)| LocationLabels {
            location: location.clone(),
        })
        .collect();
    let hub_health = HubHealth::new();
    let mut tasks = tokio::task::JoinSet::new();
    if args.exit_on_kubeconfig_change {
        tasks.spawn(kubeconfig_watch::exit_on_change(
            group.kubeconfig.clone(),
            kubeconfig,
            cancel.clone(),
        ));
    }
    {
        let (hub_health, hub, cancel, health, metrics, key) = (
            hub_health.clone(),
            hub.clone(),
            cancel.clone(),
            health.clone(),
            metrics.clone(),
            key.clone(),
        );
        tasks.spawn(async move {
            let shown = server.clone();
            hub_health
                .monitor(hub, &server, Duration::from_secs(1), cancel, move |state| {
                    for labels in &locations {
                        metrics.hub_up.get_or_create(labels).set(i64::from(state.answers()));
                    }
                    match state.problem(&shown) {
                        None => health.clear(&key),
                        Some(problem) => health.set(&key, problem),
                    }
                })
                .await;
        });
    }
    for (location, cell, policy) in group.cells {
        let settings = Settings {
            location: location.clone(),
            workers: args.workers,
            echo_bookkeeping: args.echo_bookkeeping,
        };
        let (sync, writers) = CellSync::new(
            settings,
            rules.clone(),
            cell,
            hub.clone(),
            hub_health.clone(),
            metrics.clone(),
            health.clone(),
        );
        if args.leader_elect {
            let election = election::Settings {
                namespace: args.lease_namespace.clone(),
                identity: identity.clone(),
                duration: args.lease_duration,
                grace: args.lease_grace,
            };
            tasks.spawn(elect_while_unclaimed(
                Arc::clone(&sync),
                hub.clone(),
                location,
                election,
                metrics.clone(),
                hub_health.clone(),
                cancel.clone(),
            ));
        } else {
            sync.set_leader(true);
        }
        tasks.spawn(Arc::clone(&sync).run(writers, cancel.clone()));
        tasks.spawn(outage::run(Arc::clone(&sync), policy, health.clone(), cancel.clone()));
        tasks.spawn(sweep::run(
            sync,
            metrics.clone(),
            sweep::Settings {
                interval: args.sweep_interval,
                max_deletes: args.sweep_max_deletes,
            },
            cancel.clone(),
        ));
    }
    while tasks.join_next().await.is_some() {}
}

/// Takes part in the election of `location` while no other cell publishes it: a replica that
/// finds its location claimed by another cell (see `CellSync`'s write gate) leaves the election,
/// releasing the Lease if it holds it, so that the cell that published first keeps a writer;
/// it joins again once the claim is gone.
async fn elect_while_unclaimed(
    sync: Arc<CellSync>,
    hub: kube::Client,
    location: String,
    settings: election::Settings,
    metrics: Metrics,
    hub_health: HubHealth,
    cancel: CancellationToken,
) {
    let mut gate = sync.subscribe_gate();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            closed = async { gate.wait_for(|g| !g.claimed_elsewhere).await.is_err() } => if closed { return },
        }
        let term = cancel.child_token();
        let (leader, errors, lease_location) = (Arc::clone(&sync), metrics.clone(), location.clone());
        let election = election::run(
            hub.clone(),
            location.clone(),
            settings.clone(),
            term.clone(),
            election::Reports {
                on_change: move |leading| leader.set_leader(leading),
                on_error: move |class: crate::api_errors::ErrorClass| {
                    errors
                        .errors
                        .get_or_create(&ErrorLabels {
                            kind: "Lease".to_owned(),
                            location: lease_location.clone(),
                            class: class.metric_label(),
                        })
                        .inc();
                },
                hub_health: hub_health.clone(),
            },
        );
        tokio::pin!(election);
        tokio::select! {
            () = &mut election => return,
            closed = async { gate.wait_for(|g| g.claimed_elsewhere).await.is_err() } => {
                term.cancel();
                election.await;
                sync.set_leader(false);
                if closed {
                    return;
                }
                tracing::warn!(location = %location, "another cell publishes this location: left the election");
            }
        }
    }
}
