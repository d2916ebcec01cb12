//! What the hub's admission policies cost per write (section 6 of the report, issue #18).
//!
//! The replicator churns at the target rate, `target_windows` windows with the
//! ValidatingAdmissionPolicies of `config/rbac/hub/admission_policy.yaml` in force and as many
//! with them suspended, alternating (in force, suspended, suspended, in force, …) over the same
//! load, so that drift of the shared machine lands on both; each window measures the hub
//! kube-apiserver's CPU time over its writes and their settling as the churn windows of
//! section 1 do ([`super::churn_window`]).
//!
//! Suspending deletes the bindings of the replicator's policies (the harness's `-e2e` ones, the
//! shipped-name ones and any other overlay's `-<suffix>` ones present; membership's first, the
//! location policy's last), each
//! saved first to `<state>/`[`SAVED`]; restoring server-side applies them again, as the field
//! manager that had applied them, in the same order. Each switch waits, with a deadline, until
//! the hub acts on it: a probe write the location policy refuses, made as a location identity
//! of its own ([`PROBE_LOCATION`]), is accepted once the bindings are gone and refused again
//! once they are back. The probe is a dry-run patch of the publishing-cell annotation of a copy
//! of that location in a scratch namespace: the policy refuses it (a copy's publishing cell
//! never changes), nothing is written when it is accepted, and as `replicator-env audit` judges
//! writes (label and name) it is a write to the identity's own copy, never a foreign one.
//!
//! The bindings are restored whatever happens to the windows. A run killed while they were
//! suspended leaves [`SAVED`] behind, and the next run restores them before anything else
//! ([`recover`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Client, ResourceExt as _};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{LOCATION_LABEL, LagRow, Options, Side, churn_window};
use crate::rbac::KARMADA_SKIP_PROPAGATION_LABEL;
use crate::wait::Check;
use crate::{Environment, HUB, fixtures};

/// The location whose identity (`replicator-bench-probe`, an environment fixture like every
/// location's) makes the probe writes.
pub const PROBE_LOCATION: &str = "bench-probe";
/// The file in the environment's state directory holding the bindings while they are suspended.
pub const SAVED: &str = "bench-suspended-admission-bindings.json";
/// The replicator's admission policies under their shipped names; the harness installs them
/// suffixed `-e2e` ([`crate::rbac::NAME_SUFFIX`]), a scenario deploying the manifests may add
/// others with suffixes of its own.
const POLICIES: [&str; 2] = ["replicator-location", "replicator-membership"];
/// The policy of the location identities: the one the probe meets.
const LOCATION_POLICY: &str = "replicator-location";
/// How long the hub may take to act on a removed or restored binding.
const SWITCH_DEADLINE: Duration = Duration::from_secs(30);
/// The label (value `"true"`) of the probe's scratch namespaces on the hub.
const SCRATCH_LABEL: &str = "replicator-bench.datumapis.com/admission-probe";
/// The field manager of a restored binding whose original manager is unknown.
const FIELD_MANAGER: &str = "replicator-bench";

/// The replicator's churn at one rate with the admission policies in force and suspended.
#[derive(Debug, Clone)]
pub struct Cost {
    /// The windows with the policies in force, pooled.
    pub in_force: LagRow,
    /// The windows with their bindings removed, pooled.
    pub suspended: LagRow,
    /// The bindings suspended, by name.
    pub bindings: Vec<String>,
    /// The longest any removal or restoration took to take effect (the probe's wait).
    pub switch: Duration,
}

impl Cost {
    /// The hub apiserver's CPU per acknowledged cell write, milliseconds: (in force, suspended).
    pub fn hub_cpu_per_write_ms(&self) -> (Option<f64>, Option<f64>) {
        (self.in_force.cpu_per_write_ms().0, self.suspended.cpu_per_write_ms().0)
    }
}

/// Whether `policy` (a binding's `policyName`) is one of the replicator's: as shipped, or with a
/// `-<suffix>` an overlay appended (the harness's `-e2e`). Any of them would hold the location
/// identities to their copies, so all are suspended together.
pub fn replicator_policy(policy: &str) -> bool {
    POLICIES.iter().any(|p| named(policy, p))
}

/// Whether `name` is `base` or `base-<suffix>`.
fn named(name: &str, base: &str) -> bool {
    name.strip_prefix(base)
        .is_some_and(|rest| rest.is_empty() || rest.len() > 1 && rest.starts_with('-'))
}

/// The order bindings are removed and restored in: membership's before the location policy's,
/// so that when the probe (which meets the location policy) sees a change, the hub has seen the
/// others' too (one watch delivers the bindings to the apiserver, in order); by name otherwise.
fn switch_order(bindings: &mut [Saved]) {
    bindings.sort_by_key(|b| (is_location_policy(&b.policy), b.name.clone()));
}

fn is_location_policy(policy: &str) -> bool {
    named(policy, LOCATION_POLICY)
}

fn binding_resource() -> ApiResource {
    ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: "ValidatingAdmissionPolicyBinding".into(),
        plural: "validatingadmissionpolicybindings".into(),
    }
}

/// A suspended binding: what to apply to restore it, and as which field manager.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Saved {
    name: String,
    policy: String,
    manager: String,
    body: Value,
}

impl Saved {
    /// The binding as it can be applied again: its name, labels, annotations and spec, applied
    /// by the manager that applied it (the first `Apply` entry of its managed fields).
    fn of(binding: &DynamicObject) -> Saved {
        let manager = binding
            .managed_fields()
            .iter()
            .find(|f| f.operation.as_deref() == Some("Apply"))
            .and_then(|f| f.manager.clone())
            .unwrap_or_else(|| FIELD_MANAGER.to_owned());
        let resource = binding_resource();
        let mut metadata = json!({"name": binding.name_any()});
        if !binding.labels().is_empty() {
            metadata["labels"] = json!(binding.labels());
        }
        if !binding.annotations().is_empty() {
            metadata["annotations"] = json!(binding.annotations());
        }
        Saved {
            name: binding.name_any(),
            policy: binding.data["spec"]["policyName"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            manager,
            body: json!({
                "apiVersion": resource.api_version,
                "kind": resource.kind,
                "metadata": metadata,
                "spec": binding.data["spec"],
            }),
        }
    }

    async fn apply(&self, api: &Api<DynamicObject>) -> Result<(), kube::Error> {
        let params = PatchParams::apply(&self.manager).force();
        let patch = Patch::Apply(&self.body);
        super::retrying(|| api.patch(&self.name, &params, &patch))
            .await
            .map(drop)
    }
}

/// The bindings of the replicator's policies, and whether they are suspended now.
struct Bindings {
    api: Api<DynamicObject>,
    saved: Vec<Saved>,
    file: PathBuf,
    suspended: bool,
}

impl Bindings {
    async fn find(env: &Environment, hub: &Client) -> anyhow::Result<Bindings> {
        let api = Api::<DynamicObject>::all_with(hub.clone(), &binding_resource());
        let params = ListParams::default();
        let listed = super::retrying(|| api.list(&params)).await?.items;
        let mut saved: Vec<Saved> = listed
            .iter()
            .map(Saved::of)
            .filter(|s| replicator_policy(&s.policy))
            .collect();
        switch_order(&mut saved);
        Ok(Bindings {
            api,
            saved,
            file: env.dir().join(SAVED),
            suspended: false,
        })
    }

    fn names(&self) -> Vec<String> {
        self.saved.iter().map(|s| s.name.clone()).collect()
    }

    /// Deletes the bindings (saved to the file first) and waits until the probe is accepted;
    /// returns how long that took.
    async fn suspend(&mut self, probe: &Probe) -> anyhow::Result<Duration> {
        std::fs::write(&self.file, serde_json::to_vec_pretty(&self.saved)?)
            .with_context(|| format!("writing {}", self.file.display()))?;
        self.suspended = true;
        let start = Instant::now();
        let params = DeleteParams::default();
        for binding in &self.saved {
            match super::retrying(|| self.api.delete(&binding.name, &params)).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(error) => return Err(error).context(format!("deleting binding {}", binding.name)),
            }
        }
        probe.wait(false).await?;
        let took = start.elapsed();
        progress!(
            " admission: suspended bindings {} (the probe accepted after {:.0} ms)",
            self.names().join(", "),
            took.as_secs_f64() * 1e3
        );
        Ok(took)
    }

    /// Applies the bindings again, removes the file and waits until the probe is refused;
    /// returns how long that took.
    async fn restore(&mut self, probe: &Probe) -> anyhow::Result<Duration> {
        let start = Instant::now();
        for binding in &self.saved {
            binding
                .apply(&self.api)
                .await
                .with_context(|| format!("restoring binding {}", binding.name))?;
        }
        self.suspended = false;
        remove_file(&self.file)?;
        probe.wait(true).await?;
        let took = start.elapsed();
        progress!(
            " admission: restored bindings {} (the probe refused after {:.0} ms)",
            self.names().join(", "),
            took.as_secs_f64() * 1e3
        );
        Ok(took)
    }
}

fn remove_file(path: &std::path::Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Restores the bindings an earlier run left suspended (it was killed between a suspension and
/// the restoration: [`SAVED`] is still there), and says so in `warnings`.
///
/// # Errors
/// An unreadable file, or a binding that cannot be applied (the file is then kept).
pub async fn recover(env: &Environment, warnings: &mut Vec<String>) -> anyhow::Result<()> {
    let file = env.dir().join(SAVED);
    let text = match std::fs::read(&file) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error).with_context(|| format!("reading {}", file.display())),
    };
    let saved: Vec<Saved> = serde_json::from_slice(&text).with_context(|| format!("parsing {}", file.display()))?;
    let api = Api::<DynamicObject>::all_with(env.client(HUB).await?, &binding_resource());
    for binding in &saved {
        binding
            .apply(&api)
            .await
            .with_context(|| format!("restoring binding {} from {}", binding.name, file.display()))?;
    }
    remove_file(&file)?;
    let note = format!(
        "restored the admission policy bindings an interrupted earlier run had left suspended ({})",
        saved.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
    );
    progress!(" {note}");
    warnings.push(note);
    Ok(())
}

/// What the hub answered the probe.
enum Answer {
    /// Refused by an admission policy (403 naming a ValidatingAdmissionPolicy), with the message.
    Refused(String),
    Accepted,
}

/// The probe write: a dry-run patch, as [`PROBE_LOCATION`]'s identity, that would change the
/// publishing cell of that location's copy in a scratch namespace.
struct Probe {
    hub: Client,
    slices: Api<EndpointSlice>,
    namespace: String,
    name: String,
}

impl Probe {
    /// Creates the scratch namespace (labelled [`SCRATCH_LABEL`], not propagated by Karmada;
    /// those an earlier, killed run left are deleted first) and the probe's copy (as the admin:
    /// a copy of [`PROBE_LOCATION`], publishing cell `probe`), and the probe identity.
    async fn start(env: &Environment, hub: &Client) -> anyhow::Result<Probe> {
        let identities = env.least_privilege().await?;
        let kubeconfig = identities.hub_kubeconfig_for(env, PROBE_LOCATION).await?;
        let as_location = crate::kubeconfig::client(&kubeconfig).await?;
        remove_scratch_namespaces(hub).await?;
        let namespace = fixtures::unique("bench-admission");
        let namespaces = Api::<Namespace>::all(hub.clone());
        let body = json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": namespace,
                "labels": {SCRATCH_LABEL: "true", KARMADA_SKIP_PROPAGATION_LABEL: "true"},
            },
        });
        namespaces
            .create(&PostParams::default(), &serde_json::from_value(body)?)
            .await
            .context("creating the admission probe's namespace")?;
        let probe = Probe {
            hub: hub.clone(),
            slices: Api::namespaced(as_location, &namespace),
            name: format!("probe-{PROBE_LOCATION}"),
            namespace,
        };
        let copy = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": probe.name,
                "namespace": probe.namespace,
                "labels": {LOCATION_LABEL: PROBE_LOCATION},
                "annotations": {replicator::copy::CELL_ANNOTATION: "probe"},
            },
            "addressType": "IPv6",
            "endpoints": [],
        });
        if let Err(error) = fixtures::apply(hub, &ApiResource::erase::<EndpointSlice>(&()), &copy).await {
            probe.remove().await;
            return Err(error).context("creating the admission probe's copy");
        }
        Ok(probe)
    }

    async fn answer(&self) -> Result<Answer, kube::Error> {
        let params = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        let patch = json!({"metadata": {"annotations": {replicator::copy::CELL_ANNOTATION: "probe-moved"}}});
        match self.slices.patch(&self.name, &params, &Patch::Merge(&patch)).await {
            Ok(_) => Ok(Answer::Accepted),
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("ValidatingAdmissionPolicy") => {
                Ok(Answer::Refused(s.message))
            }
            Err(error) => Err(error),
        }
    }

    /// Waits until the probe is refused (`in_force`) or accepted.
    async fn wait(&self, in_force: bool) -> anyhow::Result<()> {
        let what = if in_force {
            "the hub to refuse the admission probe (policies in force)"
        } else {
            "the hub to accept the admission probe (policies suspended)"
        };
        crate::wait::until_observed(SWITCH_DEADLINE, what, || async {
            Ok::<_, kube::Error>(match (self.answer().await?, in_force) {
                (Answer::Refused(_), true) | (Answer::Accepted, false) => Check::Ready(()),
                (Answer::Refused(message), false) => Check::NotYet(format!("refused: {message}")),
                (Answer::Accepted, true) => Check::NotYet("accepted".to_owned()),
            })
        })
        .await?;
        Ok(())
    }

    /// Deletes the probe's copy and the scratch namespace (best effort: a failure is logged).
    async fn remove(&self) {
        let slices = Api::<EndpointSlice>::namespaced(self.hub.clone(), &self.namespace);
        match slices.delete(&self.name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(error) => tracing::warn!(%error, "could not delete the admission probe's copy"),
        }
        let namespaces = Api::<Namespace>::all(self.hub.clone());
        match namespaces.delete(&self.namespace, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(error) => tracing::warn!(%error, namespace = self.namespace, "could not delete the probe's namespace"),
        }
    }
}

/// Deletes the scratch namespaces a run killed during the measurement left on the hub (with
/// their probe copies), saying so.
async fn remove_scratch_namespaces(hub: &Client) -> anyhow::Result<()> {
    let namespaces = Api::<Namespace>::all(hub.clone());
    let selector = ListParams::default().labels(SCRATCH_LABEL);
    let left = super::retrying(|| namespaces.list_metadata(&selector)).await?.items;
    for namespace in left.iter().filter(|n| n.metadata.deletion_timestamp.is_none()) {
        let name = namespace.name_any();
        match namespaces.delete(&name, &DeleteParams::default()).await {
            Ok(_) => progress!(" admission: deleted the probe namespace {name} an earlier run left"),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(error) => return Err(error).context(format!("deleting the probe namespace {name}")),
        }
    }
    Ok(())
}

/// Measures [`Cost`] with the replicator of `side` at the target rate, `window` being the
/// recorder's next window index (advanced past the windows used). `None` when the hub has no
/// binding of the replicator's policies. The bindings are in force again when it returns, also
/// on error (unless restoring them failed: the error says so, and [`recover`] restores them at
/// the next run).
///
/// # Errors
/// A probe that never sees a switch take effect, a failed churn window or binding write.
pub(super) async fn measure(
    env: &Environment,
    options: &Options,
    side: &Side<'_>,
    window: &mut usize,
) -> anyhow::Result<Option<Cost>> {
    let hub = env.client(HUB).await?;
    let mut bindings = Bindings::find(env, &hub).await?;
    if bindings.saved.is_empty() {
        progress!(" admission: the hub has no binding of the replicator's admission policies: not measured");
        return Ok(None);
    }
    let probe = Probe::start(env, &hub).await?;
    let measured = alternate(env, options, side, window, &probe, &mut bindings).await;
    let restored = if bindings.suspended {
        bindings.restore(&probe).await.map(drop)
    } else {
        Ok(())
    };
    probe.remove().await;
    if let Err(error) = &restored {
        progress!(
            " admission: COULD NOT RESTORE the bindings ({error:#}); {} keeps them for the next run",
            bindings.file.display()
        );
    }
    let (in_force, suspended, switch) = measured?;
    restored?;
    let cost = Cost {
        in_force,
        suspended,
        bindings: bindings.names(),
        switch,
    };
    let (with, without) = cost.hub_cpu_per_write_ms();
    let (difference, ratio) = super::report::difference(with, without);
    progress!(
        " admission: hub CPU per write {:.2} ms with the policies, {:.2} ms without ({:+.2} ms, {:.2}×)",
        with.unwrap_or(f64::NAN),
        without.unwrap_or(f64::NAN),
        difference.unwrap_or(f64::NAN),
        ratio.unwrap_or(f64::NAN),
    );
    Ok(Some(cost))
}

/// The alternating windows (see the module documentation): (in force, suspended, longest
/// switch). Leaves `bindings.suspended` telling whether they must still be restored.
async fn alternate(
    env: &Environment,
    options: &Options,
    side: &Side<'_>,
    window: &mut usize,
    probe: &Probe,
    bindings: &mut Bindings,
) -> anyhow::Result<(LagRow, LagRow, Duration)> {
    probe
        .wait(true)
        .await
        .context("the replicator's admission policies are not in force before the measurement")?;
    let sides = [true, false].map(|in_force| Side {
        who: if in_force {
            "replicator, admission policies in force"
        } else {
            "replicator, admission policies suspended"
        },
        load: side.load,
        recorder: side.recorder,
        replicators: side.replicators,
        pids: side.pids.clone(),
    });
    let mut rows: [Vec<LagRow>; 2] = [Vec::new(), Vec::new()];
    let mut switch = Duration::ZERO;
    let turns = options.target_windows.max(1);
    for turn in 0..turns {
        let order = if turn % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let in_force = i == 0;
            if in_force == bindings.suspended {
                let took = if in_force {
                    bindings.restore(probe).await?
                } else {
                    bindings.suspend(probe).await?
                };
                switch = switch.max(took);
            }
            rows[i].push(churn_window(env, options, &sides[i], options.target_rate, *window).await?);
            *window += 1;
        }
    }
    let [in_force, suspended] = rows.map(LagRow::pooled);
    for (row, side) in [&in_force, &suspended].into_iter().zip(&sides) {
        progress!(
            " {} at {}/s, {turns} windows pooled: {}",
            side.who,
            options.target_rate,
            row.summary()
        );
    }
    Ok((in_force, suspended, switch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replicators_policies_are_recognised_as_shipped_and_suffixed() {
        for policy in [
            "replicator-location",
            "replicator-membership",
            "replicator-location-e2e",
            "replicator-membership-e2e",
            "replicator-location-58601f",
        ] {
            assert!(replicator_policy(policy), "{policy}");
        }
        for policy in [
            "e2e-reject-slices",
            "replicator-locations",
            "replicator-location-",
            "replicator",
            "x-replicator-location",
        ] {
            assert!(!replicator_policy(policy), "{policy}");
        }
    }

    #[test]
    fn the_location_policys_bindings_switch_last() {
        let mut bindings: Vec<Saved> = [
            "replicator-location-e2e",
            "replicator-membership",
            "replicator-location",
            "replicator-membership-e2e",
        ]
        .iter()
        .map(|name| Saved {
            name: (*name).to_owned(),
            policy: (*name).to_owned(),
            manager: FIELD_MANAGER.to_owned(),
            body: Value::Null,
        })
        .collect();
        switch_order(&mut bindings);
        let names: Vec<&str> = bindings.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "replicator-membership",
                "replicator-membership-e2e",
                "replicator-location",
                "replicator-location-e2e"
            ]
        );
    }

    #[test]
    fn a_saved_binding_is_applied_back_as_its_manager_with_its_spec() {
        let binding: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {
                "name": "replicator-location-e2e",
                "uid": "u",
                "resourceVersion": "12",
                "labels": {"app.kubernetes.io/name": "replicator"},
                "managedFields": [
                    {"manager": "kube-apiserver", "operation": "Update", "apiVersion": "v1"},
                    {"manager": "replicator-e2e", "operation": "Apply", "apiVersion": "v1"},
                ],
            },
            "spec": {"policyName": "replicator-location-e2e", "validationActions": ["Deny"]},
        }))
        .expect("a valid binding");
        let saved = Saved::of(&binding);
        assert_eq!(saved.name, "replicator-location-e2e");
        assert_eq!(saved.policy, "replicator-location-e2e");
        assert_eq!(saved.manager, "replicator-e2e");
        assert_eq!(
            saved.body,
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": "replicator-location-e2e", "labels": {"app.kubernetes.io/name": "replicator"}},
                "spec": {"policyName": "replicator-location-e2e", "validationActions": ["Deny"]},
            }),
            "no uid, resourceVersion or managed fields"
        );
        let round: Vec<Saved> =
            serde_json::from_slice(&serde_json::to_vec(std::slice::from_ref(&saved)).expect("serialisable"))
                .expect("parsable");
        assert_eq!(round, [saved]);
    }

    #[test]
    fn the_probe_identity_is_a_location() {
        crate::rbac::validate_location(PROBE_LOCATION).expect("a location that can name a hub identity");
    }
}
