//! The hub apiserver's audit log, read back: who wrote what.
//!
//! The local hub logs every write (create, update, patch, delete, deletecollection) at
//! `Metadata` level as JSON lines ([`crate::Environment::hub_audit_log`]); reads are not logged.
//! A line is one `audit.k8s.io/v1` Event at stage `ResponseComplete` (or `Panic`). Only the
//! fields the security checks need are read: the user, the verb, the object and the response
//! code. Lines that are not such events (a rotated file's partial last line) are counted, not
//! fatal.

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
    /// Whether the request changed something: a write verb answered with a 2xx code.
    pub fn succeeded_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        ) && self
            .response_status
            .as_ref()
            .is_some_and(|s| (200..300).contains(&s.code))
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

/// Reads the audit log at `path`.
///
/// # Errors
/// The file cannot be read (the hub has not been started with auditing).
pub fn read(path: &Path) -> Result<Log> {
    let text = std::fs::read_to_string(path).map_err(io_context(format!("reading {}", path.display())))?;
    Ok(parse(&text))
}

/// Entries whose request came from service account `namespace/name`.
pub fn by_service_account<'a>(log: &'a Log, namespace: &str, name: &str) -> Vec<&'a Entry> {
    log.entries
        .iter()
        .filter(|e| e.service_account() == Some((namespace, name)))
        .collect()
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

    #[test]
    fn an_empty_log_is_an_error_not_zero_writes() {
        let path = Path::new("/nowhere/hub-audit.log");
        let err = require_entries(&parse(""), path).unwrap_err().to_string();
        assert!(err.contains("/nowhere/hub-audit.log"), "{err}");
        assert!(require_entries(&parse(LINES), path).is_ok());
    }
}
