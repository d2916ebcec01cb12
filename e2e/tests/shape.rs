//! Sources that change shape (issue 15, item 5): a galactic slice deleted and re-created under
//! the same name with the other `addressType` (immutable on the hub) while the replicator was
//! stopped. The copy must follow: no apply can change `addressType`, so the replicator replaces
//! the copy (delete with its UID, create) and counts `replicator_writes_total{op="replace"}`.
// In a test a panic is the failure report, with the value that broke the expectation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kube::ResourceExt;
use replicator::copy::copy_name;
use replicator_e2e::{
    CELL_A, Environment, HUB, ReplicatorProcess, ReplicatorSpec, deploy,
    fixtures::{self, CONVERGE, unique},
};
use serde_json::json;

#[tokio::test]
async fn a_slice_recreated_with_the_other_address_type_while_stopped_replaces_its_copy() -> anyhow::Result<()> {
    let env = Environment::ensure_up().await?;
    let (ns, loc) = (unique("shape"), unique("loc"));
    let mut teardown = deploy::Teardown::new(&env, &[&loc]).await?;
    for cluster in [HUB, CELL_A] {
        teardown.namespace(cluster, &ns);
    }
    fixtures::routed_namespace(&env, &ns).await?;
    let (cell, hub) = (env.client(CELL_A).await?, env.client(HUB).await?);
    let es = fixtures::resource("endpointslices")?;
    let copy = copy_name(&ns, "pod-a", &loc);

    let spec = || ReplicatorSpec::new(CELL_A).location(&loc).identity(format!("{loc}-0"));
    let mut r = ReplicatorProcess::spawn(&env, spec()).await?;
    r.wait_ready(Duration::from_secs(60)).await?;
    fixtures::apply(
        &cell,
        &es,
        &fixtures::galactic_slice(&ns, "pod-a", json!([fixtures::pod_endpoint("fd20::1", "pod-a")]), None),
    )
    .await?;
    let first = fixtures::wait_for(&hub, &es, &ns, &copy, CONVERGE, "the IPv6 copy", |_| true).await?;
    assert_eq!(first.data["addressType"], "IPv6");
    r.kill().await?;

    // Re-created as IPv4 while nothing watches.
    fixtures::delete(&cell, &es, &ns, "pod-a").await?;
    fixtures::wait_gone(&cell, &es, &ns, "pod-a", CONVERGE).await?;
    let mut ipv4 = fixtures::galactic_slice(&ns, "pod-a", json!([fixtures::pod_endpoint("10.1.0.7", "pod-a")]), None);
    ipv4["addressType"] = json!("IPv4");
    fixtures::apply(&cell, &es, &ipv4).await?;

    let mut r = ReplicatorProcess::spawn(&env, spec()).await?;
    r.wait_ready(Duration::from_secs(60)).await?;
    let replaced = fixtures::wait_for(
        &hub,
        &es,
        &ns,
        &copy,
        CONVERGE,
        "the copy to follow its source to IPv4",
        |c| c.data["addressType"] == "IPv4",
    )
    .await?;
    assert_eq!(replaced.data["endpoints"][0]["addresses"], json!(["10.1.0.7"]));
    assert_ne!(replaced.uid(), first.uid(), "a new object, not a patched one");
    let labels = [("kind", "EndpointSlice"), ("location", loc.as_str()), ("op", "replace")];
    let replacements = r.metric("replicator_writes_total", &labels).await?;
    assert_eq!(replacements, Some(1.0), "one replacement counted");
    let errors = r
        .metric(
            "replicator_errors_total",
            &[
                ("kind", "EndpointSlice"),
                ("location", loc.as_str()),
                ("class", "invalid"),
            ],
        )
        .await?;
    assert_eq!(errors, None, "the refused apply is not left as an error");

    // And with the replicator running, back to IPv6: the delete and the create reach the copy
    // in order.
    fixtures::delete(&cell, &es, &ns, "pod-a").await?;
    fixtures::wait_gone(&hub, &es, &ns, &copy, CONVERGE).await?;
    fixtures::apply(
        &cell,
        &es,
        &fixtures::galactic_slice(&ns, "pod-a", json!([fixtures::pod_endpoint("fd20::2", "pod-a")]), None),
    )
    .await?;
    let back = fixtures::wait_for(&hub, &es, &ns, &copy, CONVERGE, "the IPv6 copy again", |c| {
        c.data["addressType"] == "IPv6"
    })
    .await?;
    assert_eq!(back.data["endpoints"][0]["addresses"], json!(["fd20::2"]));
    drop(r);
    teardown.finish(&env).await?;
    Ok(())
}
