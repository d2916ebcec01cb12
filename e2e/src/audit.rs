//! The hub apiserver's audit log, read back: who wrote what.
//!
//! The local hub logs every write (create, update, patch, delete, deletecollection) as JSON
//! lines ([`crate::Environment::hub_audit_log`]): service accounts' writes (every replicator
//! identity, in whatever namespace) at `RequestResponse` level (the object as written), the
//! rest at `Metadata`; reads are not
//! logged. A line is one `audit.k8s.io/v1` Event at stage `ResponseComplete` (or `Panic`). Only
//! the fields the security checks need are read: the user, the verb, the object, the response
//! code and, of the object written, its labels and the subject of an Event. Lines that are not
//! such events (a rotated file's partial last line) are counted, not fatal.
//!
//! [`foreign_writes`] is the check of issue #18: every write a replicator identity made, judged
//! by its own rules (written here from the issue, not from the admission policy they check).

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result, io_context};

/// One audited request.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// `ResponseComplete` or `Panic` (the policy omits `RequestReceived`).
    pub stage: String,
    /// The API verb (`create`, `update`, `patch`, `delete`, `deletecollection`).
    pub verb: String,
    /// Who sent it.
    pub user: User,
    /// What it was about; absent for non-resource requests.
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    /// The answer; absent when the request panicked.
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
    /// The object as written (`RequestResponse` level only; a delete may answer a Status).
    #[serde(default)]
    pub response_object: Option<Written>,
    /// The object as sent (`RequestResponse` level only): a create's or update's object, an
    /// apply patch; a delete sends options.
    #[serde(default)]
    pub request_object: Option<Written>,
}

/// What an audit event tells of the object a write returned.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Written {
    /// `Status` when the write answered no object.
    #[serde(default)]
    pub kind: String,
    /// Its metadata (labels only).
    #[serde(default)]
    pub metadata: WrittenMeta,
    /// The object an `events.k8s.io` Event is about.
    #[serde(default)]
    pub regarding: Option<Subject>,
    /// The object a core Event is about.
    #[serde(default, rename = "involvedObject")]
    pub involved_object: Option<Subject>,
}

/// The labels of a written object.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct WrittenMeta {
    /// Its labels.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The subject of an Event.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Subject {
    /// Its kind (`NetworkService`).
    #[serde(default)]
    pub kind: String,
    /// Its name.
    #[serde(default)]
    pub name: String,
}

/// The authenticated user of a request.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct User {
    /// `system:serviceaccount:<namespace>:<name>` for a service account.
    pub username: String,
}

/// The object a request was about.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    /// The plural resource (`endpointslices`, `leases`).
    #[serde(default)]
    pub resource: String,
    /// The subresource (`status`), if any.
    #[serde(default)]
    pub subresource: Option<String>,
    /// Its namespace; absent for cluster-scoped objects and collections.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Its name; absent for a create by `generateName` or a collection.
    #[serde(default)]
    pub name: Option<String>,
    /// Its API group (`""` for the core group).
    #[serde(default)]
    pub api_group: String,
}

/// The HTTP status of the answer.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct ResponseStatus {
    /// The HTTP status code.
    pub code: u16,
}

impl Entry {
    /// Whether the request changed something: a write verb answered with a 2xx code. A create
    /// of a review (authorization.k8s.io's access reviews, authentication.k8s.io's token and
    /// self-subject reviews, which the harness's identity checks send) stores nothing: no write.
    pub fn succeeded_write(&self) -> bool {
        let review = self
            .object_ref
            .as_ref()
            .is_some_and(|o| matches!(o.api_group.as_str(), "authorization.k8s.io" | "authentication.k8s.io"));
        !review
            && matches!(
                self.verb.as_str(),
                "create" | "update" | "patch" | "delete" | "deletecollection"
            )
            && self
                .response_status
                .as_ref()
                .is_some_and(|s| (200..300).contains(&s.code))
    }

    /// Whether a create, update or patch may have been stored although its answer does not say
    /// so: the request panicked, or was answered with a server error (5xx), as when the client
    /// went away mid-request (a killed process) and the apiserver's context was cancelled after
    /// storage had committed. A 4xx answer is a refusal: nothing was stored.
    pub fn may_have_written(&self) -> bool {
        matches!(self.verb.as_str(), "create" | "update" | "patch")
            && self.response_status.as_ref().is_none_or(|s| s.code >= 500)
    }

    /// The service account `(namespace, name)` that sent the request, if one did.
    pub fn service_account(&self) -> Option<(&str, &str)> {
        let rest = self.user.username.strip_prefix("system:serviceaccount:")?;
        rest.split_once(':')
    }
}

/// The entries of an audit log and how many lines were not entries.
#[derive(Clone, Debug, Default)]
pub struct Log {
    /// Every audit event read, in file order.
    pub entries: Vec<Entry>,
    /// Lines that did not parse as an audit event.
    pub unreadable: usize,
}

/// Parses audit log text (JSON lines).
pub fn parse(text: &str) -> Log {
    let mut log = Log::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<Entry>(line) {
            Ok(entry) => log.entries.push(entry),
            Err(_) => log.unreadable += 1,
        }
    }
    log
}

/// Reads the audit log at `path` with the backups the apiserver rotated out of it
/// (`<stem>-<timestamp>.<extension>` beside it, oldest first), so a run long enough to rotate
/// is judged whole.
///
/// # Errors
/// A file cannot be read, or `path` does not exist (the hub has not been started with
/// auditing).
pub fn read(path: &Path) -> Result<Log> {
    let mut files = rotated_backups(path)?;
    files.push(path.to_path_buf());
    let mut log = Log::default();
    for file in files {
        let text = std::fs::read_to_string(&file).map_err(io_context(format!("reading {}", file.display())))?;
        let part = parse(&text);
        log.entries.extend(part.entries);
        log.unreadable += part.unreadable;
    }
    Ok(log)
}

/// The backups rotated out of the log at `path`, oldest first: files named
/// `<stem>-<timestamp>.<extension>` in its directory (the timestamps sort as text).
fn rotated_backups(path: &Path) -> Result<Vec<std::path::PathBuf>> {
    let (Some(dir), Some(stem)) = (path.parent(), path.file_stem().and_then(|s| s.to_str())) else {
        return Ok(Vec::new());
    };
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
    let prefix = format!("{stem}-");
    let suffix = format!(".{extension}");
    let listing = std::fs::read_dir(dir).map_err(io_context(format!("listing {}", dir.display())))?;
    let mut backups: Vec<std::path::PathBuf> = listing
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(&suffix))
        })
        .collect();
    backups.sort();
    Ok(backups)
}

/// Entries whose request came from service account `namespace/name`.
pub fn by_service_account<'a>(log: &'a Log, namespace: &str, name: &str) -> Vec<&'a Entry> {
    log.entries
        .iter()
        .filter(|e| e.service_account() == Some((namespace, name)))
        .collect()
}

/// The label every copy carries: the location that published it.
pub const LOCATION_LABEL: &str = "replicator.datumapis.com/location";
/// The label of the EndpointSlices `replicator membership` owns, and its value.
pub const MANAGED_BY: (&str, &str) = (
    "endpointslice.kubernetes.io/managed-by",
    "membership.replicator.datumapis.com",
);

/// Who a replicator identity is, from its service account name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Identity {
    /// `replicator-<location>`: `replicator run` of that location.
    Location(String),
    /// `replicator-membership`.
    Membership,
    /// The former shared `replicator`: it owns nothing.
    Shared,
}

impl Identity {
    /// The identity of service account `name`, if it is a replicator's (`replicator`,
    /// `replicator-membership`, `replicator-<location>`).
    pub fn of(name: &str) -> Option<Identity> {
        match name.strip_prefix("replicator") {
            Some("") => Some(Identity::Shared),
            Some("-membership") => Some(Identity::Membership),
            Some(rest) => rest
                .strip_prefix('-')
                .filter(|l| !l.is_empty())
                .map(|l| Identity::Location(l.to_owned())),
            None => None,
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Location(l) => write!(f, "replicator-{l}"),
            Identity::Membership => f.write_str("replicator-membership"),
            Identity::Shared => f.write_str("replicator"),
        }
    }
}

/// A successful write by a replicator identity to something that is not its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Foreign {
    /// The service account `namespace/name`.
    pub account: String,
    /// The verb.
    pub verb: String,
    /// `group/resource[/subresource] namespace/name`.
    pub object: String,
    /// Which rule it breaks.
    pub why: String,
}

/// What [`foreign_writes`] found.
#[derive(Clone, Debug, Default)]
pub struct Verdict {
    /// Successful writes per replicator service account (`namespace/name`).
    pub writes: std::collections::BTreeMap<String, usize>,
    /// The writes that were not the identity's own to make.
    pub foreign: Vec<Foreign>,
}

/// Judges every successful write of a replicator identity in `log` (issue #18):
/// - `replicator-<location>`: its Lease `replicator-<location>`; Events about an object named
///   `*-<location>`; any other object only when it is a copy of its location: labelled
///   `replicator.datumapis.com/location=<location>` with a name ending in `-<location>` as
///   written, or, for a delete, as the delete answered it or else as last written in the log
///   (an object never written before its delete is not a copy, as far as the log shows; a
///   write whose outcome the log leaves open, [`Entry::may_have_written`], counts as written
///   with the labels it sent);
/// - `replicator-membership`: EndpointSlices labelled managed-by membership (as written, or as
///   last written for a delete), NetworkService status, Events about NetworkServices, Leases
///   other than `replicator-*`;
/// - `replicator` (the former shared account): nothing.
///
/// A write logged without its object (`Metadata` level, e.g. a hub whose audit policy predates
/// this check) cannot be judged and counts as foreign.
pub fn foreign_writes(log: &Log) -> Verdict {
    type Key = (String, String, String, String);
    let mut last: std::collections::HashMap<Key, std::collections::BTreeMap<String, String>> =
        std::collections::HashMap::new();
    let mut verdict = Verdict::default();
    for entry in &log.entries {
        let Some(object) = entry.object_ref.as_ref() else {
            continue;
        };
        let key: Key = (
            object.api_group.clone(),
            object.resource.clone(),
            object.namespace.clone().unwrap_or_default(),
            object.name.clone().unwrap_or_default(),
        );
        let written = entry
            .response_object
            .as_ref()
            .filter(|w| w.kind != "Status" && entry.succeeded_write());
        let before = last.get(&key).cloned();
        if let Some(w) = written
            && entry.verb != "delete"
        {
            last.insert(key.clone(), w.metadata.labels.clone());
        } else if entry.may_have_written()
            && let Some(sent) = entry.request_object.as_ref().filter(|o| !o.metadata.labels.is_empty())
        {
            last.insert(key.clone(), sent.metadata.labels.clone());
        }
        let Some((namespace, account)) = entry.service_account() else {
            continue;
        };
        let Some(identity) = Identity::of(account) else {
            continue;
        };
        if !entry.succeeded_write() {
            continue;
        }
        let account = format!("{namespace}/{account}");
        *verdict.writes.entry(account.clone()).or_default() += 1;
        let name = key.3.as_str();
        let labels = if entry.verb == "delete" {
            written.map(|w| &w.metadata.labels).or(before.as_ref())
        } else {
            written.map(|w| &w.metadata.labels)
        };
        let is_event = object.resource == "events" && matches!(object.api_group.as_str(), "" | "events.k8s.io");
        let subject = written.and_then(|w| w.regarding.as_ref().or(w.involved_object.as_ref()));
        let problem: Option<String> = match &identity {
            Identity::Shared => Some("the shared account owns nothing".into()),
            Identity::Location(location) => {
                let suffix = format!("-{location}");
                if object.api_group == "coordination.k8s.io" && object.resource == "leases" {
                    (name != format!("replicator-{location}")).then(|| format!("not Lease replicator-{location}"))
                } else if is_event {
                    match subject {
                        Some(s) if s.name.ends_with(&suffix) => None,
                        Some(s) => Some(format!("an Event about {}, not a copy of {location}", s.name)),
                        None => Some("an Event whose subject the log does not show".into()),
                    }
                } else {
                    match labels.and_then(|l| l.get(LOCATION_LABEL)) {
                        Some(l) if l == location && name.ends_with(&suffix) => None,
                        Some(l) if l == location => Some(format!("a name not ending in {suffix}")),
                        Some(l) => Some(format!("a copy of location {l}")),
                        None if labels.is_some() => Some("not a copy (no location label)".into()),
                        None => Some("an object whose labels the log does not show".into()),
                    }
                }
            }
            Identity::Membership => {
                if object.api_group == "coordination.k8s.io" && object.resource == "leases" {
                    name.starts_with("replicator-").then(|| "a location's Lease".to_owned())
                } else if is_event {
                    match subject {
                        Some(s) if s.kind == "NetworkService" => None,
                        _ => Some("an Event not about a NetworkService".into()),
                    }
                } else if object.api_group == "discovery.k8s.io" && object.resource == "endpointslices" {
                    match labels.map(|l| l.get(MANAGED_BY.0).map(String::as_str)) {
                        Some(Some(v)) if v == MANAGED_BY.1 => None,
                        Some(_) => Some("an EndpointSlice membership does not manage".into()),
                        None => Some("an EndpointSlice whose labels the log does not show".into()),
                    }
                } else if object.api_group == "networking.datumapis.com"
                    && object.resource == "networkservices"
                    && object.subresource.as_deref() == Some("status")
                {
                    None
                } else {
                    Some("not membership's to write".into())
                }
            }
        };
        if let Some(why) = problem {
            verdict.foreign.push(Foreign {
                account,
                verb: entry.verb.clone(),
                object: format!(
                    "{}/{}{} {}/{}",
                    object.api_group,
                    object.resource,
                    object
                        .subresource
                        .as_deref()
                        .map(|s| format!("/{s}"))
                        .unwrap_or_default(),
                    key.2,
                    name
                ),
                why,
            });
        }
    }
    verdict
}

/// Whether `log` holds anything at all; an empty log means the hub is not audited, which a
/// check must not read as "no write happened".
///
/// # Errors
/// [`Error::Scenario`] naming `path` when it holds no entry.
pub fn require_entries(log: &Log, path: &Path) -> Result<()> {
    if log.entries.is_empty() {
        return Err(Error::Scenario(format!(
            "the hub audit log {} holds no entry: is the hub audited?",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINES: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a1","stage":"ResponseComplete","requestURI":"/apis/discovery.k8s.io/v1/namespaces/ns-1/endpointslices/pod-a-dfw?fieldManager=replicator-dfw\u0026force=true","verb":"patch","user":{"username":"system:serviceaccount:replicator-system:replicator-dfw","uid":"u","groups":["system:serviceaccounts"]},"sourceIPs":["10.0.0.1"],"userAgent":"replicator","objectRef":{"resource":"endpointslices","namespace":"ns-1","name":"pod-a-dfw","apiGroup":"discovery.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":201},"requestReceivedTimestamp":"2026-12-01T08:00:00.000000Z","stageTimestamp":"2026-12-01T08:00:00.010000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a2","stage":"ResponseComplete","requestURI":"/apis/discovery.k8s.io/v1/namespaces/ns-1/endpointslices/pod-b-sjc","verb":"delete","user":{"username":"system:serviceaccount:replicator-system:replicator-dfw"},"objectRef":{"resource":"endpointslices","namespace":"ns-1","name":"pod-b-sjc","apiGroup":"discovery.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"status":"Failure","message":"denied","reason":"Invalid","code":422}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a3","stage":"ResponseComplete","requestURI":"/healthz","verb":"create","user":{"username":"admin"}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseComplete","verb":"update","user":{"username":"system:serviceaccount:replicator-system:replicator-dfw"},"objectRef":{"resource":"networkinterfaces","subresource":"status","namespace":"ns-1","name":"nic-dfw","apiGroup":"networking.datumapis.com"},"responseStatus":{"code":200}}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseCo"#;

    #[test]
    fn entries_are_read_with_user_object_and_code() {
        let log = parse(LINES);
        assert_eq!(log.entries.len(), 4);
        assert_eq!(log.unreadable, 1, "the cut last line");
        let first = &log.entries[0];
        assert_eq!(first.verb, "patch");
        assert_eq!(first.service_account(), Some(("replicator-system", "replicator-dfw")));
        assert_eq!(
            first.object_ref,
            Some(ObjectRef {
                resource: "endpointslices".into(),
                subresource: None,
                namespace: Some("ns-1".into()),
                name: Some("pod-a-dfw".into()),
                api_group: "discovery.k8s.io".into(),
            })
        );
        assert!(first.succeeded_write());
        assert!(!log.entries[1].succeeded_write(), "refused with 422");
        assert_eq!(log.entries[2].service_account(), None);
        assert!(!log.entries[2].succeeded_write(), "no answer recorded");
        assert_eq!(
            log.entries[3]
                .object_ref
                .as_ref()
                .and_then(|o| o.subresource.as_deref()),
            Some("status")
        );
        let dfw = by_service_account(&log, "replicator-system", "replicator-dfw");
        assert_eq!(dfw.len(), 3);
        assert!(by_service_account(&log, "replicator-system", "replicator-sjc").is_empty());
    }

    /// One audit line: `user` (a service account name in `replicator-e2e`, or a plain user)
    /// `verb`s `group/resource[/sub]` `ns/name` answered `code`, returning `object` (JSON or
    /// nothing).
    fn line(user: &str, verb: &str, what: &str, at: &str, code: u16, object: Option<&str>) -> String {
        let username = if user.starts_with("replicator") {
            format!("system:serviceaccount:replicator-e2e:{user}")
        } else {
            user.to_owned()
        };
        let (group, rest) = what.split_once('/').unwrap_or(("", what));
        let (resource, sub) = match rest.split_once('/') {
            Some((r, s)) => (r, format!(r#","subresource":"{s}""#)),
            None => (rest, String::new()),
        };
        let (ns, name) = at.split_once('/').unwrap_or(("", at));
        let object = object.map(|o| format!(r#","responseObject":{o}"#)).unwrap_or_default();
        format!(
            r#"{{"kind":"Event","stage":"ResponseComplete","verb":"{verb}","user":{{"username":"{username}"}},"objectRef":{{"resource":"{resource}"{sub},"namespace":"{ns}","name":"{name}","apiGroup":"{group}"}},"responseStatus":{{"code":{code}}}{object}}}"#
        )
    }

    fn labelled(kind: &str, labels: &str) -> String {
        format!(r#"{{"kind":"{kind}","metadata":{{"name":"x","labels":{{{labels}}}}}}}"#)
    }

    /// (object, why) of every foreign write found.
    fn whys(verdict: &Verdict) -> Vec<(&str, &str)> {
        verdict
            .foreign
            .iter()
            .map(|f| (f.object.as_str(), f.why.as_str()))
            .collect()
    }

    fn judge(lines: &[String]) -> Verdict {
        foreign_writes(&parse(&lines.join("\n")))
    }

    #[test]
    fn identities_are_read_from_the_account_name() {
        assert_eq!(Identity::of("replicator-dfw"), Some(Identity::Location("dfw".into())));
        assert_eq!(
            Identity::of("replicator-us-east-1"),
            Some(Identity::Location("us-east-1".into()))
        );
        assert_eq!(Identity::of("replicator-membership"), Some(Identity::Membership));
        assert_eq!(Identity::of("replicator"), Some(Identity::Shared));
        assert_eq!(Identity::of("replicator-"), None);
        assert_eq!(Identity::of("replicatorx"), None);
        assert_eq!(Identity::of("karmada"), None);
    }

    #[test]
    fn a_location_writes_its_copies_lease_and_events_and_nothing_else() {
        let dfw = r#""replicator.datumapis.com/location":"dfw""#;
        let sjc = r#""replicator.datumapis.com/location":"sjc""#;
        let slices = "discovery.k8s.io/endpointslices";
        let lines = [
            // Own: a copy applied, its status, the Lease, an Event about a copy, a delete of a
            // copy the log saw written.
            line(
                "replicator-dfw",
                "patch",
                slices,
                "p/a-dfw",
                201,
                Some(&labelled("EndpointSlice", dfw)),
            ),
            line(
                "replicator-dfw",
                "patch",
                "networking.datumapis.com/networkinterfaces/status",
                "p/n-dfw",
                200,
                Some(&labelled("NetworkInterface", dfw)),
            ),
            line(
                "replicator-dfw",
                "patch",
                "coordination.k8s.io/leases",
                "replicator-e2e/replicator-dfw",
                200,
                Some(&labelled("Lease", "")),
            ),
            line(
                "replicator-dfw",
                "create",
                "events.k8s.io/events",
                "p/a-dfw.1",
                201,
                Some(r#"{"kind":"Event","regarding":{"kind":"EndpointSlice","name":"a-dfw"}}"#),
            ),
            line(
                "replicator-dfw",
                "delete",
                slices,
                "p/a-dfw",
                200,
                Some(r#"{"kind":"Status"}"#),
            ),
            // Refused attempts and other users are not writes of an identity.
            line("replicator-dfw", "delete", slices, "p/b-sjc", 403, None),
            line("admin", "create", slices, "p/hand", 201, None),
            // Foreign: another location's copy, a hand-made object, a name without the suffix,
            // another Lease, an Event about something else, a delete of an object the log never
            // saw written by a replicator, a write logged without its object.
            line(
                "replicator-dfw",
                "patch",
                slices,
                "p/b-sjc",
                200,
                Some(&labelled("EndpointSlice", sjc)),
            ),
            line(
                "replicator-dfw",
                "patch",
                slices,
                "p/hand",
                200,
                Some(&labelled("EndpointSlice", "")),
            ),
            line(
                "replicator-dfw",
                "patch",
                slices,
                "p/c",
                200,
                Some(&labelled("EndpointSlice", dfw)),
            ),
            line(
                "replicator-dfw",
                "patch",
                "coordination.k8s.io/leases",
                "replicator-e2e/replicator-sjc",
                200,
                Some(&labelled("Lease", "")),
            ),
            line(
                "replicator-dfw",
                "create",
                "events.k8s.io/events",
                "p/b.1",
                201,
                Some(r#"{"kind":"Event","regarding":{"kind":"EndpointSlice","name":"b-sjc"}}"#),
            ),
            line(
                "replicator-dfw",
                "delete",
                slices,
                "p/never-dfw",
                200,
                Some(r#"{"kind":"Status"}"#),
            ),
            line("replicator-dfw", "patch", slices, "p/d-dfw", 200, None),
        ];
        let verdict = judge(&lines);
        assert_eq!(verdict.writes.get("replicator-e2e/replicator-dfw"), Some(&12));
        let whys = whys(&verdict);
        assert_eq!(
            whys,
            vec![
                ("discovery.k8s.io/endpointslices p/b-sjc", "a copy of location sjc"),
                (
                    "discovery.k8s.io/endpointslices p/hand",
                    "not a copy (no location label)"
                ),
                ("discovery.k8s.io/endpointslices p/c", "a name not ending in -dfw"),
                (
                    "coordination.k8s.io/leases replicator-e2e/replicator-sjc",
                    "not Lease replicator-dfw"
                ),
                ("events.k8s.io/events p/b.1", "an Event about b-sjc, not a copy of dfw"),
                (
                    "discovery.k8s.io/endpointslices p/never-dfw",
                    "an object whose labels the log does not show"
                ),
                (
                    "discovery.k8s.io/endpointslices p/d-dfw",
                    "an object whose labels the log does not show"
                ),
            ]
        );
        assert!(
            verdict
                .foreign
                .iter()
                .all(|f| f.account == "replicator-e2e/replicator-dfw")
        );
    }

    /// `line` with the object the request sent.
    fn sent(line: String, object: &str) -> String {
        let open = line.strip_suffix('}').unwrap_or(&line);
        format!(r#"{open},"requestObject":{object}}}"#)
    }

    #[test]
    fn a_write_whose_outcome_the_log_leaves_open_counts_with_the_labels_it_sent() {
        let dfw = r#""replicator.datumapis.com/location":"dfw""#;
        let sjc = r#""replicator.datumapis.com/location":"sjc""#;
        let nics = "networking.datumapis.com/networkinterfaces";
        let status = Some(r#"{"kind":"Status"}"#);
        let lines = [
            // A killed process's apply: the apiserver answered 500 (context cancelled) after
            // storing it; the restarted process deletes the copy it cannot see written.
            sent(
                line("replicator-dfw", "patch", nics, "p/n1-dfw", 500, None),
                &labelled("NetworkInterface", dfw),
            ),
            line("replicator-dfw", "delete", nics, "p/n1-dfw", 200, status),
            // A delete answered with the object (finalizers pending) is judged by it.
            line(
                "replicator-dfw",
                "delete",
                nics,
                "p/n2-dfw",
                200,
                Some(&labelled("NetworkInterface", dfw)),
            ),
            // A refusal (409) stored nothing: sjc's copy stays sjc's, so deleting it is foreign.
            line(
                "replicator-sjc",
                "patch",
                nics,
                "p/n3-sjc",
                201,
                Some(&labelled("NetworkInterface", sjc)),
            ),
            sent(
                line("replicator-dfw", "create", nics, "p/n3-sjc", 409, None),
                &labelled("NetworkInterface", dfw),
            ),
            line("replicator-dfw", "delete", nics, "p/n3-sjc", 200, status),
            // An interrupted write that sent no labels leaves the delete unjudgeable.
            sent(
                line("replicator-dfw", "patch", nics, "p/n4-dfw", 503, None),
                &labelled("NetworkInterface", ""),
            ),
            line("replicator-dfw", "delete", nics, "p/n4-dfw", 200, status),
        ];
        let verdict = judge(&lines);
        assert_eq!(verdict.writes.get("replicator-e2e/replicator-dfw"), Some(&4));
        let whys = whys(&verdict);
        assert_eq!(
            whys,
            vec![
                (
                    "networking.datumapis.com/networkinterfaces p/n3-sjc",
                    "a copy of location sjc"
                ),
                (
                    "networking.datumapis.com/networkinterfaces p/n4-dfw",
                    "an object whose labels the log does not show"
                ),
            ]
        );
    }

    #[test]
    fn a_rotated_log_is_read_with_its_backups_oldest_first() {
        let dir = std::env::temp_dir().join(format!("replicator-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let entry = |name: &str| {
            line(
                "replicator-dfw",
                "delete",
                "discovery.k8s.io/endpointslices",
                name,
                200,
                None,
            )
        };
        std::fs::write(dir.join("hub-audit-2026-12-02T03-00-00.000.log"), entry("p/first")).unwrap();
        std::fs::write(dir.join("hub-audit-2026-12-02T04-00-00.000.log"), entry("p/second")).unwrap();
        std::fs::write(dir.join("hub-audit.log"), format!("{}\n{{cut", entry("p/third"))).unwrap();
        std::fs::write(dir.join("kube-apiserver-hub.log"), "not audit").unwrap();
        let log = read(&dir.join("hub-audit.log"));
        std::fs::remove_dir_all(&dir).unwrap();
        let log = log.unwrap();
        let names: Vec<String> = log
            .entries
            .iter()
            .filter_map(|e| e.object_ref.as_ref().and_then(|o| o.name.clone()))
            .collect();
        assert_eq!(names, ["first", "second", "third"]);
        assert_eq!(log.unreadable, 1);
    }

    #[test]
    fn membership_writes_its_slices_and_service_status_only() {
        let managed = r#""endpointslice.kubernetes.io/managed-by":"membership.replicator.datumapis.com""#;
        let slices = "discovery.k8s.io/endpointslices";
        let lines = [
            line(
                "replicator-membership",
                "patch",
                slices,
                "p/web-http",
                201,
                Some(&labelled("EndpointSlice", managed)),
            ),
            line(
                "replicator-membership",
                "delete",
                slices,
                "p/web-http",
                200,
                Some(r#"{"kind":"Status"}"#),
            ),
            line(
                "replicator-membership",
                "patch",
                "networking.datumapis.com/networkservices/status",
                "p/web",
                200,
                Some(&labelled("NetworkService", "")),
            ),
            line(
                "replicator-membership",
                "patch",
                "coordination.k8s.io/leases",
                "replicator-e2e/replicator.membership",
                200,
                Some(&labelled("Lease", "")),
            ),
            line(
                "replicator-membership",
                "create",
                "events.k8s.io/events",
                "p/web.1",
                201,
                Some(r#"{"kind":"Event","regarding":{"kind":"NetworkService","name":"web"}}"#),
            ),
            line(
                "replicator-membership",
                "patch",
                slices,
                "p/hand",
                200,
                Some(&labelled("EndpointSlice", "")),
            ),
            line(
                "replicator-membership",
                "patch",
                "networking.datumapis.com/networkservices",
                "p/web",
                200,
                Some(&labelled("NetworkService", "")),
            ),
            line(
                "replicator-membership",
                "patch",
                "coordination.k8s.io/leases",
                "replicator-e2e/replicator-dfw",
                200,
                Some(&labelled("Lease", "")),
            ),
            line(
                "replicator",
                "patch",
                slices,
                "p/a-dfw",
                200,
                Some(&labelled(
                    "EndpointSlice",
                    r#""replicator.datumapis.com/location":"dfw""#,
                )),
            ),
        ];
        let verdict = judge(&lines);
        assert_eq!(verdict.writes.get("replicator-e2e/replicator-membership"), Some(&8));
        assert_eq!(verdict.writes.get("replicator-e2e/replicator"), Some(&1));
        let whys = whys(&verdict);
        assert_eq!(
            whys,
            vec![
                (
                    "discovery.k8s.io/endpointslices p/hand",
                    "an EndpointSlice membership does not manage"
                ),
                (
                    "networking.datumapis.com/networkservices p/web",
                    "not membership's to write"
                ),
                (
                    "coordination.k8s.io/leases replicator-e2e/replicator-dfw",
                    "a location's Lease"
                ),
                (
                    "discovery.k8s.io/endpointslices p/a-dfw",
                    "the shared account owns nothing"
                ),
            ]
        );
    }

    #[test]
    fn an_empty_log_is_an_error_not_zero_writes() {
        let path = Path::new("/nowhere/hub-audit.log");
        let err = require_entries(&parse(""), path).unwrap_err().to_string();
        assert!(err.contains("/nowhere/hub-audit.log"), "{err}");
        assert!(require_entries(&parse(LINES), path).is_ok());
    }
}
