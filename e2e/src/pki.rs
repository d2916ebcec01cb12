//! The environment's PKI, made with the `openssl` CLI: a CA (whose key is kept so tests can sign
//! more serving certificates, for example for webhooks), the apiservers' serving certificate, the
//! service-account key pair and the static bearer tokens.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rand::Rng;
use tokio::process::Command;

use crate::command::run_checked;
use crate::error::{Error, Result, io_context};

/// File name stem of the apiservers' serving certificate.
const APISERVER_CERT: &str = "apiserver";
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

/// The static bearer tokens in `tokens.csv` (both users are in `system:masters`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    /// The `admin` user's token, used by the kubeconfigs and the tests.
    pub admin: String,
    /// The `system:kube-controller-manager` user's token.
    pub controller_manager: String,
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
    pub async fn create(&self) -> Result<Tokens> {
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(io_context(format!("creating {}", self.dir.display())))?;
        self.create_ca().await?;
        self.issue_serving_cert(APISERVER_CERT, &["localhost"], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])
            .await?;
        self.create_service_account_keys().await?;
        let tokens = Tokens {
            admin: random_hex(32),
            controller_manager: random_hex(32),
        };
        let csv = format!(
            "{},admin,replicator-e2e-admin,\"system:masters\"\n\
             {},system:kube-controller-manager,replicator-e2e-kcm,\"system:masters\"\n",
            tokens.admin, tokens.controller_manager
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
        let config = self.dir.join(format!("{name}.cnf"));
        write_file(
            &config,
            format!(
                "[req]\nprompt = no\ndistinguished_name = dn\n\
                 [dn]\nCN = {name}\n\
                 [v3_server]\n\
                 basicConstraints = critical, CA:FALSE\n\
                 keyUsage = critical, digitalSignature, keyEncipherment\n\
                 extendedKeyUsage = serverAuth, clientAuth\n\
                 subjectKeyIdentifier = hash\n\
                 authorityKeyIdentifier = keyid, issuer\n\
                 subjectAltName = @alt_names\n\
                 [alt_names]\n{alt_names}"
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
                .arg(self.ca_cert())
                .arg("-CAkey")
                .arg(self.ca_key())
                .arg("-set_serial")
                .arg(random_serial())
                .arg("-extfile")
                .arg(&config)
                .args(["-extensions", "v3_server"])
                .arg("-out")
                .arg(&pair.cert),
        )
        .await?;
        Ok(pair)
    }

    async fn create_ca(&self) -> Result<()> {
        let config = self.dir.join("ca.cnf");
        write_file(
            &config,
            b"[req]\nprompt = no\ndistinguished_name = dn\nx509_extensions = v3_ca\n\
              [dn]\nCN = replicator-e2e-ca\n\
              [v3_ca]\n\
              basicConstraints = critical, CA:TRUE\n\
              keyUsage = critical, keyCertSign, cRLSign, digitalSignature\n\
              subjectKeyIdentifier = hash\n",
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
                .arg(self.ca_key())
                .arg("-out")
                .arg(self.ca_cert()),
        )
        .await?;
        Ok(())
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
