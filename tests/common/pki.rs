//! Certificates made by a test with the `openssl` command: a CA, a server
//! certificate for 127.0.0.1/localhost and a client certificate signed by
//! it, and a second CA that signed nothing.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use prizepool::config::TlsFiles;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for 127.0.0.1/localhost and a client
/// certificate signed by it, and a second CA that signed nothing.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn new(tag: &str) -> Self {
        let dir = super::tempdir(tag);
        for ca in ["ca", "other-ca"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-days",
                    "2",
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.pem"),
                    "-subj",
                    &format!("/CN=prizepool test {ca}"),
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            );
        }
        // `clientAuth` too: Redis Cluster nodes present their server
        // certificate when they connect to each other's bus.
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        for leaf in ["server", "client"] {
            openssl(
                &dir,
                &[
                    "req",
                    "-new",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    &format!("{leaf}.key"),
                    "-out",
                    &format!("{leaf}.csr"),
                    "-subj",
                    &format!(
                        "/CN={}",
                        if leaf == "server" {
                            "localhost"
                        } else {
                            "postgres"
                        }
                    ),
                ],
            );
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{leaf}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &format!("{leaf}.pem"),
                    "-extfile",
                    &format!("{leaf}.ext"),
                ],
            );
        }
        Self { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn trusting(&self, ca: &str) -> TlsFiles {
        TlsFiles {
            ca_file: Some(self.path(&format!("{ca}.pem"))),
            ..TlsFiles::default()
        }
    }

    pub fn with_client_cert(&self) -> TlsFiles {
        TlsFiles {
            cert_file: Some(self.path("client.pem")),
            key_file: Some(self.path("client.key")),
            ..self.trusting("ca")
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
