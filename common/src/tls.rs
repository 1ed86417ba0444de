//! HTTPS (`--ssl-certfile`, `--ssl-keyfile`): the frontend and the router serve TLS themselves
//! (rustls, on ring's primitives), for a deployment without a terminating proxy in front. The
//! certificate chain and the key are PEM files read once at startup; a bad or missing file is a
//! startup error that names it. HTTP/1.1 only, as the plain listener.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{crypto, ServerConfig};
pub use tokio_rustls::TlsAcceptor;

/// The acceptor for the two flags' files, or None when neither is given.
pub fn tls_acceptor(
    certfile: Option<&Path>,
    keyfile: Option<&Path>,
) -> Result<Option<TlsAcceptor>, String> {
    let (certfile, keyfile) = match (certfile, keyfile) {
        (None, None) => return Ok(None),
        (Some(certfile), Some(keyfile)) => (certfile, keyfile),
        _ => return Err("give both --ssl-certfile and --ssl-keyfile, or neither".into()),
    };
    let unreadable = |flag: &str, path: &Path, error: &dyn std::fmt::Display| {
        format!("--{flag} {}: {error}", path.display())
    };
    let chain = CertificateDer::pem_file_iter(certfile)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|error| unreadable("ssl-certfile", certfile, &error))?;
    if chain.is_empty() {
        return Err(unreadable(
            "ssl-certfile",
            certfile,
            &"no PEM certificate in it",
        ));
    }
    let key = PrivateKeyDer::from_pem_file(keyfile)
        .map_err(|error| unreadable("ssl-keyfile", keyfile, &error))?;
    let provider = Arc::new(crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|error| format!("--ssl-certfile and --ssl-keyfile do not make a pair: {error}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal, for a call that must fail.
    fn refusal(certfile: Option<&Path>, keyfile: Option<&Path>) -> String {
        match tls_acceptor(certfile, keyfile) {
            Ok(_) => panic!("{certfile:?} {keyfile:?} were accepted"),
            Err(error) => error,
        }
    }

    #[test]
    fn both_files_or_neither() {
        assert!(tls_acceptor(None, None).unwrap().is_none());
        let error = refusal(Some(Path::new("/c.pem")), None);
        assert!(error.contains("both"), "{error}");
        let error = refusal(
            Some(Path::new("/nonexistent/c.pem")),
            Some(Path::new("/k.pem")),
        );
        assert!(
            error.starts_with("--ssl-certfile /nonexistent/c.pem"),
            "{error}"
        );
        let dir = std::env::temp_dir().join(format!("sluice-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = refusal(Some(&empty), Some(&empty));
        assert!(error.contains("no PEM certificate"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
