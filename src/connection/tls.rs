//! The rustls side of a connection: trusted roots (a file or the platform's), the client
//! certificate, and the server certificate verifier each `sslmode` needs, kept apart from
//! the settings so that what is checked can be read in one place.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::Verification;

pub(super) fn file_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "sslrootcert {}: no PEM certificate in the file",
            path.display()
        ));
    }
    Ok(roots)
}

pub(super) fn system_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        return Err(format!(
            "sslrootcert=system: the platform has no trusted root certificates ({} errors; \
             is the ca-certificates package installed?)",
            found.errors.len()
        ));
    }
    Ok(roots)
}

type ClientIdentity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

pub(super) fn client_identity(cert: &Path, key: &Path) -> Result<ClientIdentity, String> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("sslcert {}: no PEM certificate", cert.display()));
    }
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("sslkey {}: {e}", key.display()))?;
    Ok((certs, key))
}

pub(super) fn client_config(
    verification: Verification,
    roots: Option<RootCertStore>,
    identity: Option<ClientIdentity>,
) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = |roots: RootCertStore| {
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| format!("sslrootcert: {e}"))
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (verification, roots) {
        (Verification::ChainAndHost, Some(roots)) => webpki(roots)?,
        (Verification::Chain, Some(roots)) => Arc::new(Relaxed {
            chain: Some(webpki(roots)?),
            provider: provider.clone(),
        }),
        _ => Arc::new(Relaxed {
            chain: None,
            provider: provider.clone(),
        }),
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match identity {
        Some((certs, key)) => builder
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("sslcert/sslkey: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    // Postgres 17 refuses direct TLS negotiation without this ALPN; earlier servers ignore it.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(config)
}

/// `verify-ca`, and `prefer`/`require` (libpq's behaviour): with `chain`, the server's chain
/// must lead to a trusted root but the host name is not checked; without, the certificate is
/// not checked at all (encryption only). Handshake signatures are verified either way.
#[derive(Debug)]
struct Relaxed {
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Relaxed {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        // webpki checks the chain before the name, so a name error means the chain is good.
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
