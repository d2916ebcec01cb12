//! Readiness: the problems that keep the process from being ready, by component.
//!
//! Components set a problem while they cannot do their job (hub kubeconfig missing, hub
//! unreachable, a cell's initial list pending) and clear it when they can. `/readyz` answers 200
//! when there is none, else 503 listing them.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

/// Shared readiness state. Clones share it.
#[derive(Clone, Default)]
pub struct Health {
    problems: Arc<Mutex<BTreeMap<String, String>>>,
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.problems.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records (or replaces) the problem of `component`.
    pub fn set(&self, component: &str, problem: impl Into<String>) {
        self.lock().insert(component.to_owned(), problem.into());
    }

    /// Clears the problem of `component`.
    pub fn clear(&self, component: &str) {
        self.lock().remove(component);
    }

    /// The current problems, as `component: problem` lines; empty when ready.
    pub fn problems(&self) -> Vec<String> {
        self.lock().iter().map(|(c, p)| format!("{c}: {p}")).collect()
    }

    /// Whether no component reports a problem.
    pub fn is_ready(&self) -> bool {
        self.lock().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_without_problems() {
        let h = Health::default();
        assert!(h.is_ready());
        h.set("hub", "unreachable");
        h.set("cell dfw", "initial list pending");
        assert_eq!(h.problems(), vec!["cell dfw: initial list pending", "hub: unreachable"]);
        h.clear("hub");
        h.clear("cell dfw");
        assert!(h.is_ready());
    }
}
