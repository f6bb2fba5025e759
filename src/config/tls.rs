//! The certificate files of TLS connections to RabbitMQ, Redis and
//! Postgres, read once at start-up.

use std::path::{Path, PathBuf};

use super::ConfigError;

/// Certificate files for TLS connections to RabbitMQ, Redis and Postgres.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TlsFiles {
    /// `TLS_CA_FILE`: PEM bundle of trusted CAs; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// `TLS_CERT_FILE`: PEM client certificate (chain).
    pub cert_file: Option<PathBuf>,
    /// `TLS_KEY_FILE`: PEM private key of the client certificate.
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads `TLS_CA_FILE`, `TLS_CERT_FILE` and `TLS_KEY_FILE` from the
    /// process environment (empty counts as unset). Connections made from
    /// library code use this; [`Config::tls`] holds the same, checked.
    pub fn from_env() -> Self {
        let path = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Self {
            ca_file: path("TLS_CA_FILE"),
            cert_file: path("TLS_CERT_FILE"),
            key_file: path("TLS_KEY_FILE"),
        }
    }

    /// The CA bundle's PEM text, if one is configured.
    pub fn ca_pem(&self) -> anyhow::Result<Option<Vec<u8>>> {
        self.ca_file.as_deref().map(read_pem).transpose()
    }

    /// The client certificate and key as PEM, if configured.
    pub fn identity_pem(&self) -> anyhow::Result<Option<(Vec<u8>, Vec<u8>)>> {
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Ok(Some((read_pem(cert)?, read_pem(key)?))),
            (None, None) => Ok(None),
            _ => anyhow::bail!("TLS_CERT_FILE and TLS_KEY_FILE go together"),
        }
    }
}

/// The TLS files a worker binary configured; library code that connects
/// without a [`Config`] at hand reads them through [`TlsFiles::current`].
static INSTALLED_TLS: std::sync::OnceLock<TlsFiles> = std::sync::OnceLock::new();

impl TlsFiles {
    /// Makes these the files every later connection uses (first call wins).
    pub fn install(&self) {
        let _ = INSTALLED_TLS.set(self.clone());
    }

    /// The installed files, or else those the environment names.
    pub fn current() -> Self {
        INSTALLED_TLS.get().cloned().unwrap_or_else(Self::from_env)
    }

    /// The files in lapin's form. The CA bundle is trusted besides the
    /// system's roots; the client key may be PKCS#8, PKCS#1 or SEC1 PEM.
    pub fn amqp(&self) -> anyhow::Result<lapin::tcp::OwnedTLSConfig> {
        let cert_chain = self
            .ca_pem()?
            .map(|pem| {
                String::from_utf8(pem).map_err(|_| anyhow::anyhow!("TLS_CA_FILE is not text"))
            })
            .transpose()?;
        let identity = self
            .identity_pem()?
            .map(|(pem, key)| lapin::tcp::OwnedIdentity::PKCS8 { pem, key });
        Ok(lapin::tcp::OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }

    /// The files in redis-rs's form. A CA bundle replaces the system's roots.
    pub fn redis(&self) -> anyhow::Result<redis::TlsCertificates> {
        Ok(redis::TlsCertificates {
            client_tls: self.identity_pem()?.map(|(client_cert, client_key)| {
                redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }
            }),
            root_cert: self.ca_pem()?,
        })
    }
}

fn read_pem(path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes =
        std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        anyhow::bail!("{} holds no PEM block", path.display());
    }
    Ok(bytes)
}

/// Carries the TLS files into a Postgres URL that names none of its own, so
/// every connection made from `database_url` (pools opened lazily
/// included) verifies the server the same way.
pub(super) fn with_postgres_tls(url: &str, tls: &TlsFiles) -> Result<String, ConfigError> {
    if tls == &TlsFiles::default() {
        return Ok(url.to_owned());
    }
    let mut parsed = url::Url::parse(url)
        .map_err(|e| ConfigError::new("DATABASE_URL", format!("not a URL: {e}")))?;
    let present: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
    let has = |key: &str| present.iter().any(|k| k == key);
    let mut add: Vec<(&str, String)> = Vec::new();
    if let Some(ca) = &tls.ca_file {
        if !has("sslrootcert") {
            add.push(("sslrootcert", ca.display().to_string()));
        }
        if !has("sslmode") {
            add.push(("sslmode", "verify-full".into()));
        }
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        if !has("sslcert") {
            add.push(("sslcert", cert.display().to_string()));
            add.push(("sslkey", key.display().to_string()));
        }
    }
    if !add.is_empty() {
        let mut pairs = parsed.query_pairs_mut();
        for (k, v) in add {
            pairs.append_pair(k, &v);
        }
    }
    Ok(parsed.to_string())
}
