//! The kubeconfig files the environment writes: one per cluster for the admin user, plus one
//! for the hub's kube-controller-manager and one for the Karmada components; and, for the
//! credential-rotation scenarios, kubeconfigs whose user reads its token from a file
//! ([`write_token_file_kubeconfig`]) and files published the way the kubelet updates a mounted
//! Secret ([`publish_atomically`]).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::cluster::Cluster;

/// The directory holding the kubeconfigs inside a state directory.
pub(crate) fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("kubeconfigs")
}

/// A client authenticated as the kubeconfig file at `path` says (its current context).
///
/// # Errors
/// A file that cannot be read or parsed, or a client that cannot be built from it.
pub async fn client(path: &Path) -> crate::error::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// `<state>/kubeconfigs/<cluster>.kubeconfig`: the admin kubeconfig of a cluster.
pub fn path(state_dir: &Path, cluster: Cluster) -> PathBuf {
    dir(state_dir).join(format!("{}.kubeconfig", cluster.name()))
}

/// The kubeconfig kube-controller-manager uses to talk to the hub.
pub(crate) fn controller_manager_path(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("hub-controller-manager.kubeconfig")
}

/// The kubeconfig the Karmada components use to talk to the hub (user `system:karmada`).
pub(crate) fn karmada_path(state_dir: &Path) -> PathBuf {
    dir(state_dir).join("hub-karmada.kubeconfig")
}

/// Renders a token-authenticated kubeconfig with the CA embedded. The context is named after the
/// cluster, so that the three files can be merged through `KUBECONFIG=a:b:c`.
pub(crate) fn render(cluster: Cluster, server: &str, ca_pem: &[u8], user: &str, token: &str) -> String {
    render_user(cluster, server, ca_pem, user, &format!("token: {token}"))
}

/// Renders a kubeconfig authenticated by a client certificate (files named by path, as a
/// kubelet's `--kubeconfig` does), with the CA embedded.
pub(crate) fn render_with_certificate(
    cluster: Cluster,
    server: &str,
    ca_pem: &[u8],
    user: &str,
    cert: &Path,
    key: &Path,
) -> String {
    let credentials = format!(
        "client-certificate: {}\n\x20   client-key: {}",
        cert.display(),
        key.display()
    );
    render_user(cluster, server, ca_pem, user, &credentials)
}

/// Renders a kubeconfig whose user reads its bearer token from `token_file` (`tokenFile:`, as
/// a pod's projected service-account token is named), with the CA embedded.
pub fn render_with_token_file(cluster: Cluster, server: &str, ca_pem: &[u8], user: &str, token_file: &Path) -> String {
    render_user(
        cluster,
        server,
        ca_pem,
        user,
        &format!("tokenFile: {}", token_file.display()),
    )
}

/// Writes, at `path` (mode 0600), a kubeconfig of `cluster` in `env` whose user reads its
/// bearer token from `token_file`; the file itself is the caller's (see [`publish_atomically`]).
///
/// # Errors
/// When the CA cannot be read or the file written.
pub async fn write_token_file_kubeconfig(
    env: &crate::Environment,
    cluster: Cluster,
    token_file: &Path,
    path: &Path,
) -> crate::Result<()> {
    let ca = env.pki().ca_pem().await?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(crate::error::io_context(format!("creating {}", parent.display())))?;
    }
    let text = render_with_token_file(cluster, &env.server_url(cluster), &ca, "token-file", token_file);
    crate::files::write_private(path, &text)
}

/// Publishes `content` as `<dir>/<name>` the way the kubelet updates a mounted Secret or a
/// projected token (its AtomicWriter): the bytes go into a new directory `<dir>/..<version>`, a
/// symlink `..data_tmp` to it is renamed over `<dir>/..data` (one atomic step), `<dir>/<name>`
/// is a symlink to `..data/<name>` (made once), and the previous version directory is removed.
/// A reader of `<dir>/<name>` sees the old bytes or the new, never a partial file. `version`
/// must differ from the current one (a timestamp or a counter).
///
/// # Errors
/// The filesystem error of any step.
pub fn publish_atomically(dir: &Path, name: &str, version: &str, content: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(dir)?;
    let data = dir.join("..data");
    let previous = std::fs::read_link(&data).ok();
    let versioned = format!("..{version}");
    std::fs::create_dir_all(dir.join(&versioned))?;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(dir.join(&versioned).join(name))?;
    file.write_all(content)?;
    file.sync_all()?;
    let tmp = dir.join("..data_tmp");
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    std::os::unix::fs::symlink(&versioned, &tmp)?;
    std::fs::rename(&tmp, &data)?;
    let link = dir.join(name);
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink(Path::new("..data").join(name), &link)?;
    }
    if let Some(previous) = previous.filter(|p| p.as_os_str() != versioned.as_str()) {
        std::fs::remove_dir_all(dir.join(previous))?;
    }
    Ok(())
}

/// A kubeconfig of one cluster, one user (`credentials`: the user block's lines, the first
/// unindented) and one context named after the cluster.
fn render_user(cluster: Cluster, server: &str, ca_pem: &[u8], user: &str, credentials: &str) -> String {
    let name = cluster.name();
    let ca = STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: {name}\n\
         \x20 cluster:\n\
         \x20   server: {server}\n\
         \x20   certificate-authority-data: {ca}\n\
         users:\n\
         - name: {name}-{user}\n\
         \x20 user:\n\
         \x20   {credentials}\n\
         contexts:\n\
         - name: {name}\n\
         \x20 context:\n\
         \x20   cluster: {name}\n\
         \x20   user: {name}-{user}\n\
         current-context: {name}\n"
    )
}

/// The kubeconfig a cell's kube-controller-manager and kube-scheduler use (the
/// controller-manager token; the controllers act through their own service accounts).
pub(crate) fn cell_controller_manager_path(state_dir: &Path, cluster: Cluster) -> PathBuf {
    dir(state_dir).join(format!("{}-controller-manager.kubeconfig", cluster.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_kubeconfig_names_its_files() -> anyhow::Result<()> {
        let text = render_with_certificate(
            Cluster::CellB,
            "https://127.0.0.1:16445",
            b"PEM",
            "kubelet",
            Path::new("/pki/kubelet-cell-b.crt"),
            Path::new("/pki/kubelet-cell-b.key"),
        );
        let parsed = kube::config::Kubeconfig::from_yaml(&text)?;
        let user = parsed.auth_infos.first().and_then(|a| a.auth_info.as_ref());
        assert_eq!(
            user.and_then(|u| u.client_certificate.as_deref()),
            Some("/pki/kubelet-cell-b.crt")
        );
        assert_eq!(
            user.and_then(|u| u.client_key.as_deref()),
            Some("/pki/kubelet-cell-b.key")
        );
        assert!(user.is_some_and(|u| u.token.is_none()));
        Ok(())
    }

    #[test]
    fn a_token_file_kubeconfig_names_its_file() -> anyhow::Result<()> {
        let text = render_with_token_file(
            Cluster::Hub,
            "https://127.0.0.1:16443",
            b"PEM",
            "token-file",
            Path::new("/run/tokens/hub/token"),
        );
        let parsed = kube::config::Kubeconfig::from_yaml(&text)?;
        let user = parsed.auth_infos.first().and_then(|a| a.auth_info.as_ref());
        assert_eq!(
            user.and_then(|u| u.token_file.as_deref()),
            Some("/run/tokens/hub/token")
        );
        assert!(user.is_some_and(|u| u.token.is_none()));
        Ok(())
    }

    #[test]
    fn an_atomic_publish_swaps_the_content_behind_one_path() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("e2e-publish-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        publish_atomically(&dir, "token", "1", b"first")?;
        let path = dir.join("token");
        assert_eq!(std::fs::read(&path)?, b"first");
        assert_eq!(std::fs::read_link(&path)?, Path::new("..data/token"));
        assert_eq!(std::fs::read_link(dir.join("..data"))?, Path::new("..1"));

        publish_atomically(&dir, "token", "2", b"second")?;
        assert_eq!(std::fs::read(&path)?, b"second");
        assert_eq!(std::fs::read_link(dir.join("..data"))?, Path::new("..2"));
        assert!(!dir.join("..1").exists(), "the previous version is removed");
        assert!(!dir.join("..data_tmp").exists());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    #[test]
    fn rendered_kubeconfig_parses() -> anyhow::Result<()> {
        let text = render(Cluster::CellA, "https://127.0.0.1:16444", b"PEM", "admin", "t0k3n");
        let parsed = kube::config::Kubeconfig::from_yaml(&text)?;
        assert_eq!(parsed.current_context.as_deref(), Some("cell-a"));
        let cluster = parsed.clusters.first().and_then(|c| c.cluster.as_ref());
        assert_eq!(
            cluster.and_then(|c| c.server.as_deref()),
            Some("https://127.0.0.1:16444")
        );
        assert_eq!(
            cluster.and_then(|c| c.certificate_authority_data.as_deref()),
            Some("UEVN")
        );
        assert_eq!(parsed.auth_infos.first().map(|a| a.name.as_str()), Some("cell-a-admin"));
        Ok(())
    }
}
