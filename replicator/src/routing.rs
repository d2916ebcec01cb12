//! Project routing: which project a source belongs to, from its namespace's labels (docs/architecture.md).
//!
//! The source namespace's `meta.datumapis.com/upstream-cluster-name` and
//! `meta.datumapis.com/upstream-namespace` labels are copied verbatim onto every copy; Karmada
//! policies select on them. A namespace without both is unroutable: its objects are not
//! published, and that is made visible (metric, Event, warning) by the caller.

use std::collections::BTreeMap;

/// Namespace label naming the upstream (project) cluster, copied raw onto copies.
pub const UPSTREAM_CLUSTER_LABEL: &str = "meta.datumapis.com/upstream-cluster-name";
/// Namespace label naming the upstream (project) namespace, copied raw onto copies.
pub const UPSTREAM_NAMESPACE_LABEL: &str = "meta.datumapis.com/upstream-namespace";

/// The routing labels of a namespace, both present and non-empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    /// Raw value of `meta.datumapis.com/upstream-cluster-name`.
    pub upstream_cluster_name: String,
    /// Raw value of `meta.datumapis.com/upstream-namespace`.
    pub upstream_namespace: String,
}

impl Routing {
    /// The labels this routing puts on a copy.
    pub fn labels(&self) -> [(&'static str, &str); 2] {
        [
            (UPSTREAM_CLUSTER_LABEL, self.upstream_cluster_name.as_str()),
            (UPSTREAM_NAMESPACE_LABEL, self.upstream_namespace.as_str()),
        ]
    }
}

/// Why a namespace cannot be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unroutable {
    /// The namespace is not known (not yet listed, or deleted).
    #[error("namespace {0} not found in the cell")]
    NamespaceUnknown(String),
    /// The namespace lacks one or both routing labels.
    #[error("namespace {namespace} lacks label {missing}")]
    MissingLabel {
        /// The namespace.
        namespace: String,
        /// The first missing label key.
        missing: &'static str,
    },
}

/// Resolves the routing of `namespace` from its labels (`None` when the namespace is unknown).
///
/// # Errors
/// [`Unroutable`] when the namespace is unknown or a routing label is missing or empty.
pub fn resolve(namespace: &str, labels: Option<&BTreeMap<String, String>>) -> Result<Routing, Unroutable> {
    let labels = labels.ok_or_else(|| Unroutable::NamespaceUnknown(namespace.to_owned()))?;
    let get = |key: &'static str| {
        labels
            .get(key)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or(Unroutable::MissingLabel {
                namespace: namespace.to_owned(),
                missing: key,
            })
    };
    Ok(Routing {
        upstream_cluster_name: get(UPSTREAM_CLUSTER_LABEL)?,
        upstream_namespace: get(UPSTREAM_NAMESPACE_LABEL)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn both_labels_route_verbatim() {
        let l = labels(&[
            (UPSTREAM_CLUSTER_LABEL, "cluster-org_proj"),
            (UPSTREAM_NAMESPACE_LABEL, "default"),
        ]);
        let r = resolve("ns-1", Some(&l)).unwrap();
        assert_eq!(r.upstream_cluster_name, "cluster-org_proj");
        assert_eq!(
            r.labels(),
            [
                (UPSTREAM_CLUSTER_LABEL, "cluster-org_proj"),
                (UPSTREAM_NAMESPACE_LABEL, "default")
            ]
        );
    }

    #[test]
    fn a_missing_or_empty_label_is_unroutable() {
        let l = labels(&[(UPSTREAM_CLUSTER_LABEL, "c")]);
        assert_eq!(
            resolve("ns-1", Some(&l)),
            Err(Unroutable::MissingLabel {
                namespace: "ns-1".into(),
                missing: UPSTREAM_NAMESPACE_LABEL
            })
        );
        let l = labels(&[(UPSTREAM_CLUSTER_LABEL, ""), (UPSTREAM_NAMESPACE_LABEL, "x")]);
        assert_eq!(
            resolve("ns-1", Some(&l)).unwrap_err().to_string(),
            "namespace ns-1 lacks label meta.datumapis.com/upstream-cluster-name"
        );
        assert_eq!(resolve("ns-2", None), Err(Unroutable::NamespaceUnknown("ns-2".into())));
    }
}
