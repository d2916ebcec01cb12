//! The environment's PKI, made with the `openssl` CLI: a CA (whose key is kept so tests can sign
//! more serving certificates, for example for webhooks), the apiservers' serving certificate,
//! karmada-webhook's serving certificate, a separate front-proxy CA with the hub's aggregation
//! client certificate (CN `front-proxy-client`), the service-account key pair and the static
//! bearer tokens.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rand::Rng;
use tokio::process::Command;

use crate::command::run_checked;
use crate::error::{Error, Result, io_context};

/// File name stem of the apiservers' serving certificate.
const APISERVER_CERT: &str = "apiserver";
/// File name stem of karmada-webhook's serving certificate.
const KARMADA_WEBHOOK_CERT: &str = "karmada-webhook";
/// File name stem of the front-proxy CA (the hub's `--requestheader-client-ca-file`).
const FRONT_PROXY_CA: &str = "front-proxy-ca";
/// File name stem and common name of the hub's aggregation client certificate.
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";
/// File name stem of the apiservers' client certificate towards kubelets.
const KUBELET_CLIENT_CERT: &str = "apiserver-kubelet-client";
/// RSA key size for every key the harness makes.
const RSA_BITS: &str = "2048";
/// Validity of every certificate, in days.
const VALIDITY_DAYS: &str = "3650";

/// A certificate and its private key, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertPair {
    /// The certificate.
    pub cert: PathBuf,
    /// The unencrypted private key.
    pub key: PathBuf,
}

/// The static bearer tokens in `tokens.csv` (every user is in `system:masters`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    /// The `admin` user's token, used by the kubeconfigs, the tests and the Karmada member
    /// Secrets (Karmada reaches the members with it).
    pub admin: String,
    /// The `system:kube-controller-manager` user's token.
    pub controller_manager: String,
    /// The `system:karmada` user's token, used by the Karmada components against the hub.
    pub karmada: String,
}

/// The PKI directory of an environment.
#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A PKI rooted at `dir` (nothing is created until [`Pki::create`]).
    pub fn new(dir: impl Into<PathBuf>) -> Pki {
        Pki { dir: dir.into() }
    }

    /// The directory holding every PKI file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate (PEM).
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The CA private key (PEM), kept so that more certificates can be signed.
    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }

    /// The apiservers' serving certificate (SANs `IP:127.0.0.1`, `DNS:localhost`).
    pub fn apiserver_cert(&self) -> CertPair {
        self.pair(APISERVER_CERT)
    }

    /// karmada-webhook's serving certificate (SANs `IP:127.0.0.1`, `DNS:localhost`), signed by
    /// the CA, whose certificate is the webhook configurations' `caBundle`.
    pub fn karmada_webhook_cert(&self) -> CertPair {
        self.pair(KARMADA_WEBHOOK_CERT)
    }

    /// The front-proxy CA certificate: the hub's `--requestheader-client-ca-file`.
    pub fn front_proxy_ca_cert(&self) -> PathBuf {
        self.pair(FRONT_PROXY_CA).cert
    }

    /// The client certificate (CN `front-proxy-client`, signed by the front-proxy CA) the hub
    /// presents to aggregated apiservers: `--proxy-client-cert-file` / `--proxy-client-key-file`.
    pub fn front_proxy_client_cert(&self) -> CertPair {
        self.pair(FRONT_PROXY_CLIENT)
    }

    /// The service-account signing key (private).
    pub fn service_account_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }

    /// The service-account verification key (public).
    pub fn service_account_public_key(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }

    /// The apiservers' `--token-auth-file`.
    pub fn tokens_file(&self) -> PathBuf {
        self.dir.join("tokens.csv")
    }

    /// Reads the CA certificate.
    pub async fn ca_pem(&self) -> Result<Vec<u8>> {
        let path = self.ca_cert();
        tokio::fs::read(&path)
            .await
            .map_err(io_context(format!("reading {}", path.display())))
    }

    /// Creates the CA, the apiserver serving certificate, the service-account key pair and a
    /// `tokens.csv` with fresh random tokens, overwriting whatever is there.
    ///
    /// The apiservers' certificate names loopback, `host` (the address pods and kubelets dial:
    /// see [`crate::hostnet`]) and every cluster's `kubernetes` Service IP and DNS names, so that
    /// in-cluster clients in the cells verify it.
    pub async fn create(&self, host: Ipv4Addr) -> Result<Tokens> {
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(io_context(format!("creating {}", self.dir.display())))?;
        self.create_ca(&self.ca_pair(), "replicator-e2e-ca").await?;
        let loopback = [IpAddr::V4(Ipv4Addr::LOCALHOST)];
        let mut apiserver_ips = vec![IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V4(host)];
        apiserver_ips.extend(crate::cluster::Cluster::ALL.map(|cluster| IpAddr::V4(cluster.kubernetes_service_ip())));
        self.issue_serving_cert(
            APISERVER_CERT,
            &[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            &apiserver_ips,
        )
        .await?;
        self.issue_client_cert(
            KUBELET_CLIENT_CERT,
            "replicator-e2e-apiserver-kubelet-client",
            "system:masters",
        )
        .await?;
        self.issue_serving_cert(KARMADA_WEBHOOK_CERT, &["localhost"], &loopback)
            .await?;
        let front_proxy_ca = self.pair(FRONT_PROXY_CA);
        self.create_ca(&front_proxy_ca, "replicator-e2e-front-proxy-ca").await?;
        self.issue_cert(&front_proxy_ca, FRONT_PROXY_CLIENT, "extendedKeyUsage = clientAuth\n")
            .await?;
        self.create_service_account_keys().await?;
        let tokens = Tokens {
            admin: random_hex(32),
            controller_manager: random_hex(32),
            karmada: random_hex(32),
        };
        let csv = format!(
            "{},admin,replicator-e2e-admin,\"system:masters\"\n\
             {},system:kube-controller-manager,replicator-e2e-kcm,\"system:masters\"\n\
             {},system:karmada,replicator-e2e-karmada,\"system:masters\"\n",
            tokens.admin, tokens.controller_manager, tokens.karmada
        );
        write_file(&self.tokens_file(), csv.as_bytes()).await?;
        Ok(tokens)
    }

    /// Signs a serving certificate with the CA: `<name>.crt` / `<name>.key` in the PKI
    /// directory, common name `name`, the given DNS and IP subject alternative names, extended key
    /// usages serverAuth and clientAuth.
    pub async fn issue_serving_cert(&self, name: &str, dns_names: &[&str], ips: &[IpAddr]) -> Result<CertPair> {
        check_token(name, "certificate name")?;
        let mut alt_names = String::new();
        for (i, dns) in dns_names.iter().enumerate() {
            check_token(dns, "DNS name")?;
            let _ = writeln!(alt_names, "DNS.{} = {dns}", i + 1);
        }
        for (i, ip) in ips.iter().enumerate() {
            let _ = writeln!(alt_names, "IP.{} = {ip}", i + 1);
        }
        if alt_names.is_empty() {
            return Err(Error::Config(format!(
                "serving certificate {name} needs at least one DNS name or IP"
            )));
        }
        let extensions = format!(
            "extendedKeyUsage = serverAuth, clientAuth\n\
             subjectAltName = @alt_names\n\
             [alt_names]\n{alt_names}"
        );
        self.issue_cert(&self.ca_pair(), name, &extensions).await
    }

    /// Signs a client certificate with the CA: `<name>.crt` / `<name>.key`, subject
    /// `CN=<common_name>, O=<organization>` (Kubernetes reads them as user and group), extended key
    /// usage clientAuth. A kubelet's is `CN=system:node:<node>, O=system:nodes`.
    pub async fn issue_client_cert(&self, name: &str, common_name: &str, organization: &str) -> Result<CertPair> {
        check_token(
            common_name.trim_start_matches("system:").replace(':', "-").as_str(),
            "common name",
        )?;
        check_token(organization.replace(':', "-").as_str(), "organization")?;
        self.issue_cert_with_subject(
            &self.ca_pair(),
            name,
            &format!("CN = {common_name}\nO = {organization}"),
            "extendedKeyUsage = clientAuth\n",
        )
        .await
    }

    /// The client certificate (`O=system:masters`) the apiservers present to kubelets for logs,
    /// exec and port-forward (`--kubelet-client-certificate`).
    pub fn kubelet_client_cert(&self) -> CertPair {
        self.pair(KUBELET_CLIENT_CERT)
    }

    /// Signs `<name>.crt` / `<name>.key` (common name `name`) with the CA `ca`; `extensions` ends
    /// the `[v3_cert]` section (extended key usages, subject alternative names).
    async fn issue_cert(&self, ca: &CertPair, name: &str, extensions: &str) -> Result<CertPair> {
        check_token(name, "certificate name")?;
        self.issue_cert_with_subject(ca, name, &format!("CN = {name}"), extensions)
            .await
    }

    /// Signs `<name>.crt` / `<name>.key` with the CA `ca`; `subject` is the `[dn]` section's
    /// lines, `extensions` ends the `[v3_cert]` section.
    async fn issue_cert_with_subject(
        &self,
        ca: &CertPair,
        name: &str,
        subject: &str,
        extensions: &str,
    ) -> Result<CertPair> {
        check_token(name, "certificate name")?;
        let config = self.dir.join(format!("{name}.cnf"));
        write_file(
            &config,
            format!(
                "[req]\nprompt = no\ndistinguished_name = dn\n\
                 [dn]\n{subject}\n\
                 [v3_cert]\n\
                 basicConstraints = critical, CA:FALSE\n\
                 keyUsage = critical, digitalSignature, keyEncipherment\n\
                 subjectKeyIdentifier = hash\n\
                 authorityKeyIdentifier = keyid, issuer\n\
                 {extensions}"
            )
            .as_bytes(),
        )
        .await?;
        let pair = self.pair(name);
        let csr = self.dir.join(format!("{name}.csr"));
        run_checked(
            Command::new("openssl")
                .args(["req", "-new", "-nodes", "-newkey"])
                .arg(format!("rsa:{RSA_BITS}"))
                .arg("-config")
                .arg(&config)
                .arg("-keyout")
                .arg(&pair.key)
                .arg("-out")
                .arg(&csr),
        )
        .await?;
        run_checked(
            Command::new("openssl")
                .args(["x509", "-req", "-sha256", "-days", VALIDITY_DAYS])
                .arg("-in")
                .arg(&csr)
                .arg("-CA")
                .arg(&ca.cert)
                .arg("-CAkey")
                .arg(&ca.key)
                .arg("-set_serial")
                .arg(random_serial())
                .arg("-extfile")
                .arg(&config)
                .args(["-extensions", "v3_cert"])
                .arg("-out")
                .arg(&pair.cert),
        )
        .await?;
        Ok(pair)
    }

    /// A self-signed CA at `pair` with common name `common_name`.
    async fn create_ca(&self, pair: &CertPair, common_name: &str) -> Result<()> {
        let stem = pair
            .cert
            .file_stem()
            .map_or_else(|| "ca".into(), |stem| stem.to_string_lossy());
        let config = self.dir.join(format!("{stem}.cnf"));
        write_file(
            &config,
            format!(
                "[req]\nprompt = no\ndistinguished_name = dn\nx509_extensions = v3_ca\n\
                 [dn]\nCN = {common_name}\n\
                 [v3_ca]\n\
                 basicConstraints = critical, CA:TRUE\n\
                 keyUsage = critical, keyCertSign, cRLSign, digitalSignature\n\
                 subjectKeyIdentifier = hash\n"
            )
            .as_bytes(),
        )
        .await?;
        run_checked(
            Command::new("openssl")
                .args(["req", "-x509", "-new", "-nodes", "-sha256", "-days", VALIDITY_DAYS])
                .arg("-newkey")
                .arg(format!("rsa:{RSA_BITS}"))
                .arg("-config")
                .arg(&config)
                .arg("-keyout")
                .arg(&pair.key)
                .arg("-out")
                .arg(&pair.cert),
        )
        .await?;
        Ok(())
    }

    fn ca_pair(&self) -> CertPair {
        CertPair {
            cert: self.ca_cert(),
            key: self.ca_key(),
        }
    }

    async fn create_service_account_keys(&self) -> Result<()> {
        run_checked(
            Command::new("openssl")
                .args(["genpkey", "-algorithm", "RSA", "-pkeyopt"])
                .arg(format!("rsa_keygen_bits:{RSA_BITS}"))
                .arg("-out")
                .arg(self.service_account_key()),
        )
        .await?;
        run_checked(
            Command::new("openssl")
                .args(["pkey", "-pubout", "-in"])
                .arg(self.service_account_key())
                .arg("-out")
                .arg(self.service_account_public_key()),
        )
        .await?;
        Ok(())
    }

    fn pair(&self, name: &str) -> CertPair {
        CertPair {
            cert: self.dir.join(format!("{name}.crt")),
            key: self.dir.join(format!("{name}.key")),
        }
    }
}

/// `bytes` random bytes, hex-encoded.
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes).fold(String::with_capacity(bytes * 2), |mut out, _| {
        let _ = write!(out, "{:02x}", rng.random::<u8>());
        out
    })
}

/// A positive random 120-bit certificate serial number, as openssl's `-set_serial` accepts it.
fn random_serial() -> String {
    format!("0x{:x}", rand::rng().random::<u128>() >> 8)
}

/// Rejects values that would break the openssl config file they are written into.
fn check_token(value: &str, what: &str) -> Result<()> {
    let valid = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '*'));
    if valid {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{what} {value:?} may only contain ASCII letters, digits, '.', '-', '_' and '*'"
        )))
    }
}

async fn write_file(path: &Path, contents: &[u8]) -> Result<()> {
    tokio::fs::write(path, contents)
        .await
        .map_err(io_context(format!("writing {}", path.display())))
}
