//! Exit on a changed hub kubeconfig, so that a fixed Secret is picked up without a manual step.
//!
//! In a pod the hub kubeconfig is a mounted Secret, and the kubelet updates its file in place (an
//! atomic swap of the `..data` symlink) within about a sync period of the Secret changing. The
//! process polls the file's content every [`POLL_EVERY`] and compares a SHA-256 of the bytes
//! with that of the bytes its hub client was built from ([`crate::cluster::Hub::kubeconfig`]).
//! When they differ it logs one line, shuts down through the usual graceful path (a leader
//! releases its Lease, writes in flight finish) and exits with status 0; the kubelet
//! (`restartPolicy: Always`) restarts the container, which reads the new file.
//!
//! Why exit rather than rebuild the clients in place: every watch, the Lease manager and the
//! health probe hold the hub client, so a rebuild would restart every watch and the election
//! anyway; a clean exit does the same with the code paths every start takes, and restarting
//! containers is what the kubelet is for (the Go system did the same).
//!
//! A missing, unreadable or empty file is not a change: during the swap, or while a Secret is
//! being recreated, the old clients keep running. `--exit-on-kubeconfig-change=false` turns the
//! watch off (a bare process under a supervisor that does not restart on exit 0).
//!
//! A token file the kubeconfig names (`tokenFile:`) is not watched and its rotation ends
//! nothing: the client re-reads it by itself about once a minute (see [`crate::cluster`]), so
//! a rotated token is picked up in place. Only the bytes of the kubeconfig file count: a Secret
//! holding both the kubeconfig and its token file, updated with a new token only, leaves the
//! kubeconfig's bytes unchanged and the process running; a new server, CA or user in the
//! kubeconfig is a change and restarts it.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// How often the file is read.
pub const POLL_EVERY: Duration = Duration::from_secs(5);

/// A SHA-256 of a kubeconfig file's bytes (never of an empty file).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The first 6 bytes are plenty to tell two versions apart in a log or a test failure.
        for byte in &self.0[..6] {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl Fingerprint {
    /// The fingerprint of `bytes`; `None` for an empty file.
    pub fn of(bytes: &[u8]) -> Option<Self> {
        (!bytes.is_empty()).then(|| Self(Sha256::digest(bytes).into()))
    }
}

/// The fingerprint of the file at `path` now (symlinks followed, as the kubelet's `..data` swap
/// needs); `None` while it is missing, unreadable or empty.
pub async fn read(path: &Path) -> Option<Fingerprint> {
    tokio::fs::read(path).await.ok().as_deref().and_then(Fingerprint::of)
}

/// Whether the file, as read now (`now`), holds content other than `loaded`, the content the
/// running clients were built from. A missing or empty file (`None`) is not a change.
pub fn changed(loaded: Fingerprint, now: Option<Fingerprint>) -> bool {
    now.is_some_and(|now| now != loaded)
}

/// Reads `path` every `every` until its content differs from `loaded` (returns `true`) or
/// `cancel` fires (returns `false`).
pub async fn wait_for_change(path: &Path, loaded: Fingerprint, every: Duration, cancel: &CancellationToken) -> bool {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return false,
            () = tokio::time::sleep(every) => {}
        }
        if changed(loaded, read(path).await) {
            return true;
        }
    }
}

/// Watches the hub kubeconfig at `path` (see the module documentation): once its content
/// differs from `loaded`, logs it and cancels `cancel`, which shuts the process down gracefully
/// and makes it exit with status 0. Returns when `cancel` fires.
pub async fn exit_on_change(path: PathBuf, loaded: Fingerprint, cancel: CancellationToken) {
    if wait_for_change(&path, loaded, POLL_EVERY, &cancel).await {
        tracing::info!(
            cluster = "hub",
            path = %path.display(),
            "hub kubeconfig changed; exiting so that the kubelet restarts the container with it"
        );
        cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("replicator-kcw-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Lays out `dir` as the kubelet mounts a Secret: `..<version>/kubeconfig`, `..data` a
    /// symlink to the version directory, `kubeconfig` a symlink to `..data/kubeconfig`.
    fn kubelet_publish(dir: &Path, version: &str, content: &str) {
        let versioned = dir.join(format!("..{version}"));
        std::fs::create_dir_all(&versioned).unwrap();
        std::fs::write(versioned.join("kubeconfig"), content).unwrap();
        // The kubelet's atomic swap: a new symlink renamed over `..data`.
        let tmp = dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
        let link = dir.join("kubeconfig");
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("..data/kubeconfig", &link).unwrap();
        }
    }

    const V1: &str = "apiVersion: v1\nkind: Config\nclusters: [{name: hub, cluster: {server: https://wrong:6443}}]\n";
    const V2: &str = "apiVersion: v1\nkind: Config\nclusters: [{name: hub, cluster: {server: https://hub:6443}}]\n";

    #[test]
    fn only_other_content_is_a_change() {
        let loaded = Fingerprint::of(V1.as_bytes()).unwrap();
        assert!(!changed(loaded, Fingerprint::of(V1.as_bytes())), "same content");
        assert!(changed(loaded, Fingerprint::of(V2.as_bytes())), "changed content");
        assert!(!changed(loaded, None), "a missing file is not a change");
        assert_eq!(Fingerprint::of(b""), None, "an empty file counts as missing");
        assert!(!changed(loaded, Fingerprint::of(b"")));
    }

    #[tokio::test]
    async fn a_kubelet_symlink_swap_is_a_change_and_a_missing_file_is_not() {
        let dir = TempDir::new("swap");
        kubelet_publish(&dir.0, "2025_01_01_00_00_00.1", V1);
        let path = dir.0.join("kubeconfig");
        let loaded = read(&path).await.unwrap();
        assert!(!changed(loaded, read(&path).await), "unchanged file");

        // Temporarily missing: `..data` points nowhere (as between a Secret's delete and create).
        std::fs::remove_file(dir.0.join("..data")).unwrap();
        assert_eq!(read(&path).await, None);
        assert!(!changed(loaded, read(&path).await), "a missing file is not a change");

        // The same content published again under a new version directory: no change.
        kubelet_publish(&dir.0, "2025_01_01_00_01_00.2", V1);
        assert!(!changed(loaded, read(&path).await), "same bytes through a new ..data");

        // The fixed Secret: new content behind the same path.
        kubelet_publish(&dir.0, "2025_01_01_00_02_00.3", V2);
        assert!(
            changed(loaded, read(&path).await),
            "the ..data swap is seen through the path"
        );
    }

    #[tokio::test]
    async fn a_new_token_beside_the_kubeconfig_is_no_change() {
        // One Secret with two keys, `kubeconfig` (naming `tokenFile: token`) and `token`, as
        // the kubelet mounts it: each version directory holds both files.
        let dir = TempDir::new("token");
        let publish = |version: &str, kubeconfig: &str, token: &str| {
            let versioned = dir.0.join(format!("..{version}"));
            std::fs::create_dir_all(&versioned).unwrap();
            std::fs::write(versioned.join("token"), token).unwrap();
            kubelet_publish(&dir.0, version, kubeconfig);
        };
        publish("2025_01_01_00_00_00.1", V1, "old-token");
        let path = dir.0.join("kubeconfig");
        let loaded = read(&path).await.unwrap();

        // The token rotated: the kubeconfig's bytes are the same, the process keeps running
        // (the client re-reads the token file itself).
        publish("2025_01_01_00_01_00.2", V1, "new-token");
        assert_eq!(
            std::fs::read_to_string(dir.0.join("..data/token")).unwrap(),
            "new-token"
        );
        assert!(
            !changed(loaded, read(&path).await),
            "a token-only rotation is no change"
        );

        // The kubeconfig itself changed (another server): that is a change.
        publish("2025_01_01_00_02_00.3", V2, "new-token");
        assert!(changed(loaded, read(&path).await));
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_fires_on_new_content_only() {
        let dir = TempDir::new("watch");
        let path = dir.0.join("kubeconfig");
        std::fs::write(&path, V1).unwrap();
        let loaded = read(&path).await.unwrap();
        let cancel = CancellationToken::new();

        // Unchanged for a (virtual) minute: no change reported.
        let waited = tokio::time::timeout(
            Duration::from_secs(60),
            wait_for_change(&path, loaded, POLL_EVERY, &cancel),
        )
        .await;
        assert!(waited.is_err(), "unchanged content is not a change");

        // Missing, then empty: still none.
        std::fs::remove_file(&path).unwrap();
        let waited = tokio::time::timeout(
            Duration::from_secs(30),
            wait_for_change(&path, loaded, POLL_EVERY, &cancel),
        )
        .await;
        assert!(waited.is_err(), "a missing file is not a change");
        std::fs::write(&path, "").unwrap();
        let waited = tokio::time::timeout(
            Duration::from_secs(30),
            wait_for_change(&path, loaded, POLL_EVERY, &cancel),
        )
        .await;
        assert!(waited.is_err(), "an empty file is not a change");

        // New content: seen at the next poll, and the process is told to stop.
        std::fs::write(&path, V2).unwrap();
        let started = tokio::time::Instant::now();
        tokio::time::timeout(
            Duration::from_secs(60),
            exit_on_change(path.clone(), loaded, cancel.clone()),
        )
        .await
        .unwrap();
        assert!(cancel.is_cancelled(), "a change cancels the process");
        assert!(started.elapsed() <= POLL_EVERY, "seen within one poll");

        // Cancelled (SIGTERM): the watch ends without a change.
        assert!(!wait_for_change(&path, loaded, POLL_EVERY, &cancel).await);
    }
}
