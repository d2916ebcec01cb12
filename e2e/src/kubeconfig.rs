//! The kubeconfig files the environment writes: one per cluster for the admin user, plus one
//! for the hub's kube-controller-manager and one for the Karmada components.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::cluster::Cluster;

/// The directory holding the kubeconfigs inside a state directory.
pub(crate) fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("kubeconfigs")
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
