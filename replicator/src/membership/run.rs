//! The wiring of `replicator membership`: the hub client, metrics and probes, the reflectors,
//! the election and the workers.

use std::{sync::Arc, time::Duration};

use k8s_openapi::{api::core::v1::Namespace, api::discovery::v1::EndpointSlice};
use kube::{
    Api, ResourceExt,
    api::DynamicObject,
    runtime::watcher::{self, Event},
};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::{api_errors::ErrorClass, cluster, health::Health, http};

use super::{
    ALL_LISTED, ClassLabels, Controller, LISTS, MembershipArgs, Metrics, Writers,
    endpoints::{self},
    interface_resource, service_resource,
};

/// Runs `replicator membership` until SIGTERM or SIGINT.
///
/// # Errors
/// An unbindable address; `--lease-duration`/`--lease-grace` the Lease cannot use.
pub async fn run(args: MembershipArgs) -> anyhow::Result<()> {
    if args.leader_elect {
        crate::election::check_timing(args.lease_duration, args.lease_grace).map_err(anyhow::Error::msg)?;
    }
    let identity = args.identity.clone().unwrap_or_else(crate::election::default_identity);
    let cancel = CancellationToken::new();
    crate::runtime::spawn_signal_handler(cancel.clone());
    let mut registry = Registry::default();
    crate::metrics::register_process(&mut registry);
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::default();
    health.set(
        "hub",
        format!("waiting for hub kubeconfig {}", args.hub_kubeconfig.display()),
    );
    let mut servers = http::spawn(&args.serve, registry, health.clone(), &cancel);

    let hub = cluster::wait_for_hub_client(&args.hub_kubeconfig, Duration::from_secs(2), &cancel, &health, "hub").await;
    let Some(cluster::Hub {
        client: hub,
        server,
        kubeconfig,
    }) = hub
    else {
        return Ok(());
    };
    health.set("hub", format!("connecting to {server}"));
    health.set(LISTS, "initial list pending");
    tracing::info!(server = %server, leader_elect = args.leader_elect, identity = %identity, "hub kubeconfig loaded; starting");
    let hub_health = cluster::HubHealth::new();
    let hub_health_for_election = hub_health.clone();

    let (
        controller,
        Writers {
            interfaces,
            services,
            slices,
            namespaces,
        },
    ) = Controller::new(hub.clone(), hub_health.clone(), metrics);

    let mut tasks = tokio::task::JoinSet::new();
    if args.exit_on_kubeconfig_change {
        tasks.spawn(crate::kubeconfig_watch::exit_on_change(
            args.hub_kubeconfig.clone(),
            kubeconfig,
            cancel.clone(),
        ));
    }
    {
        let (hub, cancel, health, hub_up) = (
            hub.clone(),
            cancel.clone(),
            health.clone(),
            controller.metrics.hub_up.clone(),
        );
        tasks.spawn(async move {
            let shown = server.clone();
            hub_health
                .monitor(hub, &server, Duration::from_secs(1), cancel, move |state| {
                    hub_up.set(i64::from(state.answers()));
                    match state.problem(&shown) {
                        None => health.clear("hub"),
                        Some(problem) => health.set("hub", problem),
                    }
                })
                .await;
        });
    }
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<DynamicObject>::all_with(hub.clone(), &interface_resource()),
            watcher::Config::default(),
            interfaces,
            0b0001,
            |c: &Controller, e: &Event<DynamicObject>| match e {
                Event::Apply(o) | Event::InitApply(o) => c.interface_changed(o, false),
                Event::Delete(o) => c.interface_changed(o, true),
                Event::Init | Event::InitDone => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "NetworkInterface"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<DynamicObject>::all_with(hub.clone(), &service_resource()),
            watcher::Config::default(),
            services,
            0b0010,
            |c: &Controller, e: &Event<DynamicObject>| match e {
                Event::Apply(o) | Event::InitApply(o) | Event::Delete(o) => c.queue.add(Controller::key_of(o)),
                Event::Init | Event::InitDone => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "NetworkService"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<EndpointSlice>::all(hub.clone()),
            watcher::Config::default().labels(endpoints::NETWORK_SERVICE_LABEL),
            slices,
            0b0100,
            |c: &Controller, e: &Event<EndpointSlice>| match e {
                Event::Apply(o) | Event::Delete(o) => {
                    for owner in o.owner_references().iter().filter(|o| o.kind == "NetworkService") {
                        c.queue.add((o.namespace().unwrap_or_default(), owner.name.clone()));
                    }
                }
                _ => {}
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "EndpointSlice"),
    ));
    let c = Arc::clone(&controller);
    tasks.spawn(tracing::Instrument::instrument(
        c.watch(
            Api::<Namespace>::all(hub.clone()),
            watcher::Config::default(),
            namespaces,
            0b1000,
            |c: &Controller, e: &Event<Namespace>| {
                if let Event::Apply(ns) = e {
                    for s in c
                        .services
                        .state_filter(|s| s.namespace().as_deref() == Some(ns.name_any().as_str()))
                    {
                        c.queue.add(Controller::key_of(s.as_ref()));
                    }
                }
            },
            cancel.clone(),
        ),
        tracing::info_span!("watch", cluster = "hub", kind = "Namespace"),
    ));
    {
        let (c, health, cancel) = (Arc::clone(&controller), health.clone(), cancel.clone());
        tasks.spawn(async move {
            let mut rx = c.listed.subscribe();
            tokio::select! {
                () = cancel.cancelled() => {}
                _ = rx.wait_for(|v| *v == ALL_LISTED) => {
                    health.clear(LISTS);
                    tracing::info!(services = c.services.len(), interfaces = c.interfaces.len(), "hub caches listed; resolving services");
                }
            }
        });
    }
    if args.leader_elect {
        let c = Arc::clone(&controller);
        let errors = controller.metrics.errors.clone();
        tasks.spawn(crate::election::run_on(
            hub.clone(),
            args.lease_name.clone(),
            crate::election::Settings {
                namespace: args.lease_namespace.clone(),
                identity: identity.clone(),
                duration: args.lease_duration,
                grace: args.lease_grace,
            },
            cancel.clone(),
            crate::election::Reports {
                on_change: move |leading| c.set_leader(leading),
                on_error: move |class: ErrorClass| {
                    errors
                        .get_or_create(&ClassLabels {
                            class: class.metric_label(),
                        })
                        .inc();
                },
                hub_health: hub_health_for_election,
            },
        ));
    } else {
        controller.set_leader(true);
    }
    for _ in 0..args.workers.max(1) {
        tasks.spawn(Arc::clone(&controller).work(cancel.clone()));
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
    controller.queue.close();
    while tasks.join_next().await.is_some() {}
    while servers.join_next().await.is_some() {}
    result
}
