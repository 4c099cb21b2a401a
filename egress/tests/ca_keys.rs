//! CA keys as the real `openssl` CLI writes them with its default options are accepted:
//! SEC1 EC (`openssl ecparam -genkey`, with its `EC PARAMETERS` block), PKCS#1 RSA
//! (`openssl genrsa -traditional`, the format of Helm's `genCA`) and PKCS#8 (`openssl genpkey`).
//! Each CA is loaded, mints a leaf, and `openssl verify` accepts the leaf against the CA.

use std::{path::Path, process::Command};

use cube_egress::certs::{CA_CERT_FILE, CA_KEY_FILE, Ca, CertName};

fn openssl(dir: &Path, args: &[&str]) {
    let o = Command::new("openssl").current_dir(dir).args(args).output().expect("run openssl");
    assert!(o.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn accepts_openssl_key_formats() {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIPPED: accepts_openssl_key_formats: the openssl CLI is not installed");
        return;
    }
    let base = std::env::temp_dir().join(format!("cube-egress-ca-keys-{}", std::process::id()));
    let cases: [(&str, &[&str], &str); 3] = [
        ("sec1", &["ecparam", "-genkey", "-name", "prime256v1", "-out", CA_KEY_FILE], "BEGIN EC PRIVATE KEY"),
        ("pkcs1", &["genrsa", "-traditional", "-out", CA_KEY_FILE, "2048"], "BEGIN RSA PRIVATE KEY"),
        (
            "pkcs8",
            &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", CA_KEY_FILE],
            "BEGIN PRIVATE KEY",
        ),
    ];
    for (name, genkey, marker) in cases {
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        openssl(&dir, genkey);
        let key = std::fs::read_to_string(dir.join(CA_KEY_FILE)).unwrap();
        assert!(key.contains(marker), "{name}: expected {marker}:\n{key}");
        // `req -x509` marks the certificate CA:TRUE by default (OpenSSL 3).
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                CA_KEY_FILE,
                "-subj",
                "/CN=openssl CA",
                "-days",
                "30",
                "-out",
                CA_CERT_FILE,
            ],
        );
        let ca = Ca::load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        // The fingerprint the gateway logs at start is openssl's (O8).
        let fp = Command::new("openssl")
            .current_dir(&dir)
            .args(["x509", "-noout", "-fingerprint", "-sha256", "-in", CA_CERT_FILE])
            .output()
            .unwrap();
        let fp = String::from_utf8_lossy(&fp.stdout);
        assert_eq!(fp.trim().rsplit_once('=').map(|(_, f)| f), Some(ca.fingerprint_sha256().as_str()), "{name}");
        let (chain, _) = ca.mint(&CertName::Dns("api.example.test".into())).unwrap();
        std::fs::write(dir.join("leaf.der"), chain[0].as_ref()).unwrap();
        openssl(&dir, &["x509", "-inform", "DER", "-in", "leaf.der", "-out", "leaf.pem"]);
        openssl(&dir, &["verify", "-CAfile", CA_CERT_FILE, "leaf.pem"]);
    }
    // A file without any usable key block is refused with a clear error.
    let dir = base.join("none");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(base.join("sec1").join(CA_CERT_FILE), dir.join(CA_CERT_FILE)).unwrap();
    std::fs::write(
        dir.join(CA_KEY_FILE),
        "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n",
    )
    .unwrap();
    let e = format!("{:#}", Ca::load(&dir).unwrap_err());
    assert!(e.contains("no unencrypted PRIVATE KEY"), "{e}");
    std::fs::remove_dir_all(&base).unwrap();
}
