//! The error classes of the Kubernetes API: how the mirror, the hub probe and the membership
//! controller treat a failed request (docs/architecture.md "Errors are classified"). Classes are
//! decided by the HTTP code and the status details the apiserver sends, never by message text.

use std::time::Duration;

/// How an error is handled (docs/architecture.md "Errors are classified"). None of them withdraws what is
/// published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// The hub (or cell) did not answer: writers pause until the hub is back.
    Unreachable,
    /// A retryable API answer (409, 429, 5xx, timeouts): retried with exponential backoff.
    Transient,
    /// 401 or 403 (a revoked token, RBAC, a terminating namespace): Event, metric, slow retry.
    Forbidden,
    /// 400/422: the hub rejects the copy (e.g. its CRD differs): Event, metric, slow retry.
    Invalid,
    /// The copy's namespace does not exist on the hub; it is never created by the replicator.
    NamespaceMissing,
    /// An object of the copy's name exists on the hub without this location's label.
    NotOurs,
    /// The source cannot be turned into a copy (see [`crate::copy::Error`]); waits for a source change.
    SourceInvalid,
}

impl ErrorClass {
    /// The `class` label of `replicator_errors_total`.
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::Transient => "transient",
            Self::Forbidden => "forbidden",
            Self::Invalid => "invalid",
            Self::NamespaceMissing => "namespace_missing",
            Self::NotOurs => "not_ours",
            Self::SourceInvalid => "source_invalid",
        }
    }

    /// Delay before attempt `attempt` (1-based) of a key that failed with this class; `None`
    /// means no retry until the source changes.
    ///
    /// Transient and unreachable: 250 ms doubling to 30 s. Forbidden, invalid, missing namespace
    /// and foreign objects: 5 s doubling to 5 min, so a refused write costs at most a request
    /// every five minutes per key once settled.
    pub fn retry_after(self, attempt: u32) -> Option<Duration> {
        let exp = |base_ms: u64, cap: Duration| {
            let factor = 1u64 << attempt.saturating_sub(1).min(20);
            Some(Duration::from_millis(base_ms.saturating_mul(factor)).min(cap))
        };
        match self {
            Self::Unreachable | Self::Transient => exp(250, Duration::from_secs(30)),
            Self::Forbidden | Self::Invalid | Self::NamespaceMissing | Self::NotOurs => {
                exp(5_000, Duration::from_secs(300))
            }
            Self::SourceInvalid => None,
        }
    }

    /// The Event reason shown on the source object in the cell.
    pub fn event_reason(self) -> &'static str {
        match self {
            Self::Unreachable | Self::Transient => "HubWriteFailed",
            Self::Forbidden => "HubWriteForbidden",
            Self::Invalid => "HubRejectedCopy",
            Self::NamespaceMissing => "HubNamespaceMissing",
            Self::NotOurs => "HubNameTaken",
            Self::SourceInvalid => "SourceInvalid",
        }
    }
}

/// Whether the apiserver refused a write because it would change an immutable field (422,
/// reason `Invalid`, a cause whose message carries apimachinery's `field is immutable`, as
/// built-in kinds say, e.g. an EndpointSlice's `addressType`): the object must be replaced, not
/// patched. Read from the status details, never from the top-level message.
pub fn is_immutable_change(status: &kube::core::Status) -> bool {
    const IMMUTABLE: &str = "field is immutable";
    status.code == 422
        && status.reason == "Invalid"
        && status
            .details
            .as_ref()
            .is_some_and(|d| d.causes.iter().any(|c| c.message.contains(IMMUTABLE)))
}

/// Whether a 404 names the namespace, not the object: the apiserver's NotFound for a request into
/// a namespace that does not exist carries details `{kind: namespaces, group: ""}`.
fn is_namespace_missing(status: &kube::core::Status) -> bool {
    status.code == 404
        && status
            .details
            .as_ref()
            .is_some_and(|d| d.kind == "namespaces" && d.group.is_empty())
}

/// Classifies a Kubernetes client error by its HTTP code and the status details (never by
/// message text).
pub fn classify(err: &kube::Error) -> ErrorClass {
    match err {
        kube::Error::Api(status) => match status.code {
            404 if is_namespace_missing(status) => ErrorClass::NamespaceMissing,
            404 => ErrorClass::Invalid,
            401 | 403 => ErrorClass::Forbidden,
            400 | 422 => ErrorClass::Invalid,
            _ => ErrorClass::Transient,
        },
        kube::Error::HyperError(_) | kube::Error::Service(_) => ErrorClass::Unreachable,
        _ => ErrorClass::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_grow_and_cap_per_class() {
        assert_eq!(ErrorClass::Transient.retry_after(1), Some(Duration::from_millis(250)));
        assert_eq!(ErrorClass::Transient.retry_after(3), Some(Duration::from_millis(1000)));
        assert_eq!(ErrorClass::Transient.retry_after(40), Some(Duration::from_secs(30)));
        assert_eq!(ErrorClass::Invalid.retry_after(1), Some(Duration::from_secs(5)));
        assert_eq!(ErrorClass::Invalid.retry_after(10), Some(Duration::from_secs(300)));
        assert_eq!(ErrorClass::SourceInvalid.retry_after(1), None);
    }

    #[test]
    fn api_errors_are_classified_by_code() {
        let api = |code: u16| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                ..kube::core::Status::default()
            }))
        };
        let not_found = |kind: &str, group: &str, message: &str| {
            kube::Error::Api(Box::new(kube::core::Status {
                code: 404,
                reason: "NotFound".into(),
                message: message.into(),
                details: Some(kube::core::response::StatusDetails {
                    name: "ns-1".into(),
                    group: group.into(),
                    kind: kind.into(),
                    uid: String::new(),
                    causes: vec![],
                    retry_after_seconds: 0,
                }),
                ..kube::core::Status::default()
            }))
        };
        // What kube-apiserver answers for a write into a namespace that does not exist.
        let missing_ns = not_found("namespaces", "", "namespaces \"ns-1\" not found");
        assert_eq!(classify(&missing_ns), ErrorClass::NamespaceMissing);
        // The message alone decides nothing: an object's 404 that happens to say "namespaces".
        let object = not_found("endpointslices", "discovery.k8s.io", "namespaces \"ns-1\" not found");
        assert_eq!(classify(&object), ErrorClass::Invalid);
        // A CRD whose plural is `namespaces` in another group is not the namespace.
        assert_eq!(
            classify(&not_found("namespaces", "example.com", "")),
            ErrorClass::Invalid
        );
        assert_eq!(classify(&api(404)), ErrorClass::Invalid);
        assert_eq!(classify(&api(403)), ErrorClass::Forbidden);
        assert_eq!(
            classify(&api(401)),
            ErrorClass::Forbidden,
            "a revoked token retries slowly"
        );
        assert_eq!(classify(&api(422)), ErrorClass::Invalid);
        assert_eq!(classify(&api(409)), ErrorClass::Transient);
        assert_eq!(classify(&api(503)), ErrorClass::Transient);
        assert_eq!(ErrorClass::NamespaceMissing.metric_label(), "namespace_missing");
    }

    #[test]
    fn immutable_field_refusals_are_told_apart() {
        let status = |code: u16, message: &str, cause: Option<&str>| kube::core::Status {
            code,
            reason: if code == 422 { "Invalid" } else { "Conflict" }.into(),
            message: message.into(),
            details: cause.map(|c| kube::core::response::StatusDetails {
                name: "web-dfw".into(),
                group: "discovery.k8s.io".into(),
                kind: "EndpointSlice".into(),
                uid: String::new(),
                causes: vec![kube::core::response::StatusCause {
                    reason: "FieldValueInvalid".into(),
                    message: c.into(),
                    field: "addressType".into(),
                }],
                retry_after_seconds: 0,
            }),
            ..kube::core::Status::default()
        };
        let immutable = "EndpointSlice.discovery.k8s.io \"web-dfw\" is invalid: addressType: Invalid value: \"IPv4\": field is immutable";
        // The message alone decides nothing: the causes are the apiserver's structured answer.
        assert!(!is_immutable_change(&status(422, immutable, None)));
        assert!(is_immutable_change(&status(
            422,
            "is invalid",
            Some("Invalid value: \"IPv4\": field is immutable")
        )));
        assert!(!is_immutable_change(&status(
            422,
            "metadata.labels: Invalid value",
            None
        )));
        assert!(!is_immutable_change(&status(409, immutable, None)));
        assert!(!is_immutable_change(&status(400, immutable, None)));
    }
}
