//! Who may talk to the server: TLS (optionally mutual) on the listener, and bearer tokens
//! checked per call before the request body is read.
//!
//! - The write token, when set, is required by `ApplyExternalKvBatch`.
//! - The read token, when set, is required by the three queries and by `PredictExternalKv`
//!   (routers hold the read token; a prediction never changes the index); the write token is
//!   accepted for them too (a writer may read).
//! - `KVIndexerAdmin` (ours): `DropWorker` needs the write token, its reads the read token.
//! - Health and reflection stay open, so load balancers and `grpcurl` work without a token.
//!
//! A call without the token its method needs is answered UNAUTHENTICATED and changes nothing.

use std::path::Path;
use std::sync::Arc;

use http::HeaderMap;
use kv_common::{PemError, is_sendable_token, read_pem};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig, crypto};
use tonic::Status;

/// A TLS or token setting the server cannot use, naming the variable it read it from.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("{setting} must be visible ASCII without spaces")]
    BadToken { setting: &'static str },
    #[error(
        "KV_INDEXER_TLS_CLIENT_CA (--tls-client-ca) needs KV_INDEXER_TLS_CERT and KV_INDEXER_TLS_KEY"
    )]
    ClientCaWithoutTls,
    #[error("KV_INDEXER_TLS_CERT (--tls-cert) and KV_INDEXER_TLS_KEY (--tls-key) go together")]
    HalfTls,
    #[error(transparent)]
    Pem(#[from] PemError),
    #[error("{setting} {path:?}: {what}")]
    Tls {
        setting: &'static str,
        path: std::path::PathBuf,
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl AccessError {
    fn tls(
        setting: &'static str,
        path: &Path,
        what: &'static str,
    ) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> AccessError {
        let path = path.to_path_buf();
        move |source| AccessError::Tls {
            setting,
            path,
            what,
            source,
        }
    }
}

/// The RPC paths of the `KVIndexer` service.
const SERVICE_PREFIX: &str = "/kv_indexer.v1.KVIndexer/";
const WRITE_METHOD: &str = "ApplyExternalKvBatch";
/// The path of `MatchExternalKvPrefix`, the one RPC under admission control.
pub use kv_indexer_proto::prefix_wire::PREFIX_PATH;
/// The service's methods, for the metric label of a rejected call (and the series the server
/// exports from start).
pub(crate) const METHODS: [&str; 5] = [
    WRITE_METHOD,
    "MatchExternalKv",
    "MatchExternalKvPrefix",
    "GetExternalKvHitCounts",
    "PredictExternalKv",
];

/// The RPC paths of the `KVIndexerAdmin` service (ours): the drop writes, the rest read.
const ADMIN_PREFIX: &str = "/kv_indexer.v1.KVIndexerAdmin/";
const ADMIN_WRITE_METHOD: &str = "DropWorker";
const ADMIN_METHODS: [&str; 3] = ["GetIndexerState", "ListWorkers", ADMIN_WRITE_METHOD];

/// What a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Nothing,
    Read,
    Write,
}

impl Need {
    /// The need of the call to `path` (`/package.Service/Method`).
    pub fn of(path: &str) -> Need {
        if let Some(method) = path.strip_prefix(ADMIN_PREFIX) {
            return match method {
                ADMIN_WRITE_METHOD => Need::Write,
                _ => Need::Read,
            };
        }
        match path.strip_prefix(SERVICE_PREFIX) {
            Some(WRITE_METHOD) => Need::Write,
            Some(_) => Need::Read,
            None => Need::Nothing,
        }
    }
}

/// The method name of `path` as a static label (`"unknown"` for anything else).
pub fn method_label(path: &str) -> &'static str {
    let (method, known) = match path.strip_prefix(ADMIN_PREFIX) {
        Some(method) => (method, &ADMIN_METHODS[..]),
        None => (
            path.strip_prefix(SERVICE_PREFIX).unwrap_or(""),
            &METHODS[..],
        ),
    };
    known
        .iter()
        .copied()
        .find(|name| *name == method)
        .unwrap_or("unknown")
}

/// One token, held as the SHA-256 digest of the whole `authorization` value it must match:
/// comparing digests tells nothing about where a wrong value differs, nor its length.
#[derive(Clone)]
struct Token([u8; 32]);

impl Token {
    fn new(setting: &'static str, token: &str) -> Result<Token, AccessError> {
        if !is_sendable_token(token) {
            return Err(AccessError::BadToken { setting });
        }
        Ok(Token(digest(format!("Bearer {token}").as_bytes())))
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(…)")
    }
}

/// The tokens the server requires (none by default).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    write: Option<Token>,
    read: Option<Token>,
}

impl Tokens {
    /// `write` guards applies, `read` guards queries; `None` leaves that side open.
    pub fn new(write: Option<&str>, read: Option<&str>) -> Result<Tokens, AccessError> {
        Ok(Tokens {
            write: write
                .map(|t| Token::new("KV_INDEXER_WRITE_TOKEN (--write-token)", t))
                .transpose()?,
            read: read
                .map(|t| Token::new("KV_INDEXER_READ_TOKEN (--read-token)", t))
                .transpose()?,
        })
    }

    /// Whether a call to `path` with these `headers` may proceed.
    pub fn check(&self, path: &str, headers: &HeaderMap) -> Result<(), Status> {
        // Digested once, compared with each token that may accept it.
        let given = headers
            .get(http::header::AUTHORIZATION)
            .map(|value| digest(value.as_bytes()));
        let accepted = |token: &Option<Token>| {
            token
                .as_ref()
                .is_some_and(|token| given.is_some_and(|given| token.0 == given))
        };
        let (needed, ok) = match Need::of(path) {
            Need::Nothing => return Ok(()),
            Need::Write if self.write.is_none() => return Ok(()),
            Need::Read if self.read.is_none() => return Ok(()),
            Need::Write => ("write", accepted(&self.write)),
            Need::Read => ("read", accepted(&self.read) || accepted(&self.write)),
        };
        if ok {
            return Ok(());
        }
        let why = if given.is_none() { "missing" } else { "wrong" };
        Err(Status::unauthenticated(format!(
            "{} needs the Indexer's {needed} token: authorization header {why}",
            method_label(path)
        )))
    }

    pub fn any(&self) -> bool {
        self.write.is_some() || self.read.is_some()
    }
}

/// The access settings as plain values: the certificate files and the tokens (`config` parses
/// the flags into them).
#[derive(Debug, Clone, Copy, Default)]
pub struct AccessConfig<'a> {
    pub tls_cert: Option<&'a Path>,
    pub tls_key: Option<&'a Path>,
    pub tls_client_ca: Option<&'a Path>,
    pub write_token: Option<&'a str>,
    pub read_token: Option<&'a str>,
}

/// Everything that decides who may connect and call.
#[derive(Clone, Default)]
pub struct Access {
    pub tls: Option<TlsAcceptor>,
    /// True when the TLS listener requires a client certificate.
    pub mutual_tls: bool,
    pub tokens: Tokens,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("tls", &self.tls.is_some())
            .field("mutual_tls", &self.mutual_tls)
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl Access {
    /// Reads the certificate files and tokens `settings` name.
    pub fn from_settings(settings: &AccessConfig<'_>) -> Result<Access, AccessError> {
        let tokens = Tokens::new(settings.write_token, settings.read_token)?;
        let tls = match (settings.tls_cert, settings.tls_key) {
            (None, None) if settings.tls_client_ca.is_some() => {
                return Err(AccessError::ClientCaWithoutTls);
            }
            (None, None) => None,
            (Some(cert), Some(key)) => Some(server_tls(cert, key, settings.tls_client_ca)?),
            _ => return Err(AccessError::HalfTls),
        };
        Ok(Access {
            tls,
            mutual_tls: settings.tls_client_ca.is_some(),
            tokens,
        })
    }

    /// Start-up warnings for a server listening on `addr` with these settings.
    pub fn warnings(&self, addr: std::net::SocketAddr) -> Vec<String> {
        let mut warnings = Vec::new();
        if !addr.ip().is_loopback() && self.tls.is_none() {
            warnings.push(format!(
                "listening on {addr}, beyond loopback, without TLS: anyone on the network can read the traffic{}; set KV_INDEXER_TLS_CERT and KV_INDEXER_TLS_KEY",
                if self.tokens.any() {
                    ", tokens included"
                } else {
                    " and, without KV_INDEXER_WRITE_TOKEN, write to the index"
                }
            ));
        }
        if self.tokens.read.is_some() && self.tokens.write.is_none() {
            warnings.push(
                "a read token but no write token: queries need a token, applies do not".into(),
            );
        }
        warnings
    }
}

/// The TLS acceptor: `cert`/`key` PEM files, ALPN h2, and a required client certificate signed
/// by `client_ca` when given.
pub fn server_tls(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<TlsAcceptor, AccessError> {
    const KEY: &str = "KV_INDEXER_TLS_KEY";
    let provider = Arc::new(crypto::ring::default_provider());
    let chain = certificates("KV_INDEXER_TLS_CERT", cert)?;
    let key_pem = read_pem(KEY, key, "PRIVATE KEY")?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| AccessError::tls(KEY, key, "not a usable private key")(e.into()))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| AccessError::tls(KEY, key, "no TLS protocol version")(e.into()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => builder.with_client_cert_verifier(client_verifier(path, provider)?),
    };
    let mut config = builder.with_single_cert(chain, key_der).map_err(|e| {
        AccessError::tls(KEY, key, "the key does not fit the certificate")(e.into())
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Requires a client certificate signed by a CA of `path`.
fn client_verifier(
    path: &Path,
    provider: Arc<crypto::CryptoProvider>,
) -> Result<Arc<dyn tokio_rustls::rustls::server::danger::ClientCertVerifier>, AccessError> {
    const CA: &str = "KV_INDEXER_TLS_CLIENT_CA";
    let mut roots = RootCertStore::empty();
    for ca in certificates(CA, path)? {
        roots
            .add(ca)
            .map_err(|e| AccessError::tls(CA, path, "not a usable CA certificate")(e.into()))?;
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| AccessError::tls(CA, path, "no usable client verifier")(e.into()))
}

fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, AccessError> {
    let pem = read_pem(what, path, "CERTIFICATE")?;
    CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| AccessError::tls(what, path, "a certificate block does not parse")(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = value {
            headers.insert(http::header::AUTHORIZATION, value.parse().unwrap());
        }
        headers
    }

    const APPLY: &str = "/kv_indexer.v1.KVIndexer/ApplyExternalKvBatch";
    const PREFIX: &str = "/kv_indexer.v1.KVIndexer/MatchExternalKvPrefix";
    const HEALTH: &str = "/grpc.health.v1.Health/Check";

    #[test]
    fn classifies_methods() {
        assert_eq!(Need::of(APPLY), Need::Write);
        assert_eq!(Need::of(PREFIX), Need::Read);
        assert_eq!(
            Need::of("/kv_indexer.v1.KVIndexer/GetExternalKvHitCounts"),
            Need::Read
        );
        assert_eq!(Need::of(HEALTH), Need::Nothing);
        assert_eq!(method_label(PREFIX), "MatchExternalKvPrefix");
        assert_eq!(method_label(HEALTH), "unknown");
        // The admin service: the drop writes, the rest read.
        let drop = "/kv_indexer.v1.KVIndexerAdmin/DropWorker";
        let workers = "/kv_indexer.v1.KVIndexerAdmin/ListWorkers";
        assert_eq!(Need::of(drop), Need::Write);
        assert_eq!(Need::of(workers), Need::Read);
        assert_eq!(method_label(drop), "DropWorker");
        assert_eq!(
            method_label("/kv_indexer.v1.KVIndexerAdmin/Nope"),
            "unknown"
        );
    }

    #[test]
    fn no_tokens_leave_everything_open() {
        let tokens = Tokens::default();
        for path in [APPLY, PREFIX, HEALTH] {
            assert!(tokens.check(path, &headers(None)).is_ok());
        }
    }

    #[test]
    fn write_token_guards_applies_and_opens_queries() {
        let tokens = Tokens::new(Some("w-secret"), Some("r-secret")).unwrap();
        let check = |path, value| {
            tokens
                .check(path, &headers(value))
                .map_err(|s| s.message().to_string())
        };
        assert!(check(APPLY, Some("Bearer w-secret")).is_ok());
        assert!(check(PREFIX, Some("Bearer w-secret")).is_ok());
        assert!(check(PREFIX, Some("Bearer r-secret")).is_ok());
        assert!(check(HEALTH, None).is_ok());
        let denied = check(APPLY, Some("Bearer r-secret")).unwrap_err();
        assert!(
            denied.contains(
                "ApplyExternalKvBatch needs the Indexer's write token: authorization header wrong"
            ),
            "{denied}"
        );
        let denied = check(PREFIX, None).unwrap_err();
        assert!(
            denied.contains("read token: authorization header missing"),
            "{denied}"
        );
        assert!(check(APPLY, Some("Bearer w-secre")).is_err());
        assert!(check(APPLY, Some("Bearer w-secrett")).is_err());
        assert!(check(APPLY, Some("w-secret")).is_err());
    }

    #[test]
    fn write_token_alone_leaves_queries_open() {
        let tokens = Tokens::new(Some("w"), None).unwrap();
        assert!(tokens.check(PREFIX, &headers(None)).is_ok());
        let status = tokens.check(APPLY, &headers(None)).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn rejects_tokens_that_cannot_be_sent() {
        for bad in ["", "with space", "tab\t"] {
            let error = Tokens::new(Some(bad), None).unwrap_err().to_string();
            assert!(error.contains("KV_INDEXER_WRITE_TOKEN"), "{error}");
        }
    }

    #[test]
    fn warns_beyond_loopback_without_tls() {
        let open = Access::default();
        assert!(open.warnings("[::1]:50051".parse().unwrap()).is_empty());
        assert!(open.warnings("127.0.0.1:50051".parse().unwrap()).is_empty());
        let warnings = open.warnings("0.0.0.0:50051".parse().unwrap());
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("without TLS"), "{warnings:?}");
        let read_only = Access {
            tokens: Tokens::new(None, Some("r")).unwrap(),
            ..Access::default()
        };
        let warnings = read_only.warnings("[::1]:50051".parse().unwrap());
        assert!(warnings[0].contains("no write token"), "{warnings:?}");
    }
}
