//! The failure of one pass over one key, and the class that decides its retry, Event and metric.

use crate::{
    api_errors::{ErrorClass, classify},
    copy,
};

/// A failed pass over one key.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A hub request failed.
    #[error("hub request failed: {0}")]
    Hub(#[source] kube::Error),
    /// An object of the copy's name on the hub is not this location's copy.
    #[error(
        "hub object {namespace}/{name} (the copy name of source {source_key} of location {location}) is {holder}, without label {label}={location}; refusing to touch it"
    )]
    NotOurs {
        /// Namespace of the hub object.
        namespace: String,
        /// Name of the hub object.
        name: String,
        /// The location label key.
        label: &'static str,
        /// This location.
        location: String,
        /// The source whose copy name it is, `namespace/name`.
        source_key: String,
        /// What the object is: another location's copy (naming its source and location) or an
        /// object the replicator did not publish.
        holder: String,
    },
    /// The copy under this location's label was published by another cell (one cell per
    /// location): never modified.
    #[error("hub copy {namespace}/{name} was published by another cell (kube-system UID {cell}); refusing to touch it")]
    OtherCell {
        /// Namespace of the copy.
        namespace: String,
        /// Name of the copy.
        name: String,
        /// The other cell's ID.
        cell: String,
    },
    /// The cell's identity is not known yet (no write goes out without it).
    #[error("the cell is not identified yet (its kube-system namespace is not listed)")]
    CellUnidentified,
    /// A confirming read of the cell failed (the copy it was about stays as it is).
    #[error("cell read failed: {0}")]
    Cell(#[source] kube::Error),
    /// The source cannot be turned into a copy.
    #[error("source cannot be copied: {0}")]
    Source(#[from] copy::Error),
    /// A cached object could not be read back (see [`crate::cache::Cached::object`]).
    #[error("cached {what} {namespace}/{name} is unreadable: {source}")]
    Cache {
        /// "source" or "copy".
        what: &'static str,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The parse error.
        source: serde_json::Error,
    },
}

impl Error {
    /// The class deciding retry, Event and metric.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Hub(e) => classify(e),
            // Retried with backoff; never taken for the hub being down.
            Self::Cell(_) => ErrorClass::Transient,
            Self::NotOurs { .. } | Self::OtherCell { .. } => ErrorClass::NotOurs,
            Self::CellUnidentified => ErrorClass::Transient,
            Self::Source(_) | Self::Cache { .. } => ErrorClass::SourceInvalid,
        }
    }
}
