//! The hub apiserver stopped for 30 seconds while cells change (issue 2, §6): once it returns,
//! the hub converges to the cells' state, nothing is lost and no copy is deleted because of the
//! outage. The hub is started again whatever happens while it is down (an error or a failed
//! assertion included), and a [`Teardown`] removes the namespace and the Leases.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;

use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, Environment, HUB, ReplicatorProcess, ReplicatorSpec,
    fixtures::{self, Teardown, unique},
    wait,
};
use serde_json::json;

#[tokio::test]
async fn a_30_second_hub_outage_converges_with_nothing_lost() -> Result<(), Box<dyn std::error::Error>> {
    let env = Environment::ensure_up().await?;
    let (ns, loc, stop_loc) = (unique("outage"), unique("loc"), unique("stop"));
    let mut teardown = Teardown::new(&env);
    teardown.namespace(&[HUB, CELL_A], &ns);
    teardown.lease(&format!("replicator-{loc}"));
    teardown.lease(&format!("replicator-{stop_loc}"));
    // The second replicator starts while the hub is down: its hub identity must exist before.
    env.least_privilege().await?.hub_kubeconfig_for(&env, &stop_loc).await?;
    fixtures::routed_namespace(&env, &ns).await?;
    let cell = env.client(CELL_A).await?;
    let es = fixtures::resource("endpointslices")?;
    let ni = fixtures::resource("networkinterfaces")?;
    let mut r = ReplicatorProcess::spawn(
        &env,
        ReplicatorSpec::new(CELL_A)
            .location(&loc)
            .args(["--sweep-interval", "5s", "--rules"])
            .arg(fixtures::scenario_rules(
                &env,
                &ns,
                &["endpointslices", "networkinterfaces"],
            )?),
    )
    .await?;
    r.wait_ready(Duration::from_secs(60)).await?;

    // Its own sources only (fixtures::scenario_rules): the withdrawals counted below are its own.
    let slice = |name: &str, addr: &str| {
        fixtures::scenario_labelled(fixtures::galactic_slice(
            &ns,
            name,
            json!([fixtures::pod_endpoint(addr, name)]),
            None,
        ))
    };
    for i in 0..10 {
        fixtures::apply(&cell, &es, &slice(&format!("before-{i}"), "fd20::10")).await?;
    }
    fixtures::apply(
        &cell,
        &ni,
        &fixtures::scenario_labelled(fixtures::network_interface(&ns, "nic", "default", "claim", "web", &loc)),
    )
    .await?;
    {
        let hub = env.client(HUB).await?;
        for i in 0..10 {
            fixtures::wait_for(
                &hub,
                &es,
                &ns,
                &copy_name(&ns, &format!("before-{i}"), &loc),
                fixtures::CONVERGE,
                "copy",
                |_| true,
            )
            .await?;
        }
        fixtures::wait_for(
            &hub,
            &ni,
            &ns,
            &copy_name(&ns, "nic", &loc),
            fixtures::CONVERGE,
            "copy",
            |_| true,
        )
        .await?;
    }

    env.stop_apiserver(HUB).await?;
    let down_at = Instant::now();
    let outage = AssertUnwindSafe(async {
        wait::until(Duration::from_secs(20), "replicator to report the hub down", || async {
            Ok::<_, replicator_e2e::Error>(
                r.metric("replicator_hub_up", &[("location", loc.as_str())])
                    .await?
                    .filter(|v| *v == 0.0),
            )
        })
        .await?;
        // Changes while the hub is away: creates, an update, a delete, a status change.
        for i in 0..20 {
            fixtures::apply(&cell, &es, &slice(&format!("during-{i}"), "fd20::20")).await?;
        }
        fixtures::apply(&cell, &es, &slice("before-0", "fd20::99")).await?;
        fixtures::delete(&cell, &es, &ns, "before-1").await?;
        fixtures::set_status(&cell, &ni, &ns, "nic", fixtures::bound_status(true)).await?;
        // The fault lasts the scenario's 30 s: this holds the outage, it synchronises nothing.
        tokio::time::sleep_until((down_at + Duration::from_secs(30)).into()).await;
        assert!(r.try_exit_status()?.is_none(), "the replicator survived the outage");
        // SIGTERM while the hub is away: the process exits promptly instead of waiting for it.
        let mut stopping = ReplicatorProcess::spawn(&env, ReplicatorSpec::new(CELL_A).location(&stop_loc)).await?;
        let health = stopping.health_url();
        wait::until(
            Duration::from_secs(30),
            "the second replicator to answer its probes",
            || {
                let url = format!("{health}/healthz");
                async move {
                    Ok::<_, replicator_e2e::Error>(
                        replicator_e2e::replicator_process::http_get(&url)
                            .await
                            .ok()
                            .map(|_| ()),
                    )
                }
            },
        )
        .await?;
        let status = stopping.terminate(Duration::from_secs(10)).await?;
        assert!(
            status.success(),
            "clean exit on SIGTERM during a hub outage: {status:?}"
        );
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .catch_unwind()
    .await;
    // The fault ends whatever the outage's checks found.
    env.start_apiserver(HUB).await?;
    match outage {
        Ok(result) => result?,
        Err(panic) => std::panic::resume_unwind(panic),
    }
    let back_at = Instant::now();

    let hub = env.client(HUB).await?;
    for i in 0..20 {
        fixtures::wait_for(
            &hub,
            &es,
            &ns,
            &copy_name(&ns, &format!("during-{i}"), &loc),
            Duration::from_secs(60),
            "created during outage",
            |_| true,
        )
        .await?;
    }
    fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "before-0", &loc),
        Duration::from_secs(60),
        "updated during outage",
        |o| {
            serde_json::to_value(o)
                .map(|v| v["endpoints"][0]["addresses"][0] == "fd20::99")
                .unwrap_or(false)
        },
    )
    .await?;
    fixtures::wait_gone(
        &hub,
        &es,
        &ns,
        &copy_name(&ns, "before-1", &loc),
        Duration::from_secs(60),
    )
    .await?;
    fixtures::wait_for(
        &hub,
        &ni,
        &ns,
        &copy_name(&ns, "nic", &loc),
        Duration::from_secs(60),
        "status written during outage",
        |o| {
            serde_json::to_value(o)
                .map(|v| v["status"]["phase"] == "Bound")
                .unwrap_or(false)
        },
    )
    .await?;
    eprintln!("hub converged {:?} after it returned", back_at.elapsed());
    for i in 2..10 {
        assert!(
            fixtures::get(&hub, &es, &ns, &copy_name(&ns, &format!("before-{i}"), &loc))
                .await?
                .is_some(),
            "before-{i} lost in the outage"
        );
    }
    let deletes = r
        .counter(
            "replicator_writes_total",
            &[("kind", "EndpointSlice"), ("location", loc.as_str()), ("op", "delete")],
        )
        .await?;
    let swept = r
        .counter(
            "replicator_sweep_deleted_total",
            &[("kind", "EndpointSlice"), ("location", loc.as_str())],
        )
        .await?;
    assert_eq!(deletes + swept, 1.0, "exactly the one deleted source was withdrawn");
    wait::until(Duration::from_secs(30), "readiness to return", || async {
        Ok::<_, replicator_e2e::Error>(
            r.metric("replicator_hub_up", &[("location", loc.as_str())])
                .await?
                .filter(|v| *v == 1.0),
        )
    })
    .await?;
    Ok(())
}
