//! What an Indexer client sends beyond the address: TLS (the roots that verify the server, the
//! client's own certificate for mutual TLS) and the bearer token. The router, the bridge and
//! the CLI all connect through [`Credentials`], so each takes the same options.
//!
//! Files are read and checked once, at start-up, and a bad one is named in the error: a
//! missing file, a file without a PEM certificate or key, a key without its certificate, TLS
//! options for a plain `http://` endpoint, a token that cannot be a header value.

use std::fmt;
use std::path::PathBuf;

pub use kv_common::{PemError, Secret, is_sendable_token, read_pem};

use kv_indexer_proto::MAX_MESSAGE_BYTES;
use kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// The client's TLS and token settings, as given (paths, not yet read).
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct ClientSecurity {
    /// PEM CA certificate(s) that verify the Indexer's certificate, instead of the system's
    /// roots (`https://` endpoints only).
    #[cfg_attr(feature = "cli", arg(long = "indexer-ca", env = "KV_INDEXER_TLS_CA"))]
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain this client presents when the Indexer requires mutual TLS.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "indexer-client-cert",
            env = "KV_INDEXER_CLIENT_CERT",
            requires = "key_file"
        )
    )]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of that certificate.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "indexer-client-key",
            env = "KV_INDEXER_CLIENT_KEY",
            requires = "cert_file"
        )
    )]
    pub key_file: Option<PathBuf>,
    /// The name the Indexer's certificate must carry, when not the endpoint's host.
    #[cfg_attr(
        feature = "cli",
        arg(long = "indexer-tls-domain", env = "KV_INDEXER_TLS_DOMAIN")
    )]
    pub tls_domain: Option<String>,
    /// Bearer token sent with every call (`authorization: Bearer …`); prefer the variable,
    /// which `ps` does not show.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "indexer-token",
            env = "KV_INDEXER_TOKEN",
            hide_env_values = true
        )
    )]
    pub token: Option<Secret>,
}

/// A client security setting that cannot work, naming it.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Pem(#[from] PemError),
    #[error("a client certificate needs its key and a key its certificate (give both)")]
    HalfIdentity,
    #[error("the Indexer token must be visible ASCII without spaces")]
    BadToken,
    #[error(
        "TLS options (CA, client certificate, TLS domain) are given but endpoint {endpoint} is not https://"
    )]
    TlsOnPlainEndpoint { endpoint: String },
    #[error("endpoint {endpoint}: TLS settings rejected")]
    Tls {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("endpoint {endpoint}: not a valid address")]
    Address {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// The settings, read and checked: what every connection to the Indexer uses.
#[derive(Debug, Clone)]
pub struct Credentials {
    #[cfg(feature = "tls")]
    tls: tonic::transport::ClientTlsConfig,
    /// True when any TLS option was given (so a plain endpoint is a mistake).
    tls_options: bool,
    authorization: Authorize,
}

/// Adds `authorization: Bearer <token>` to every call when a token is set.
#[derive(Clone, Default)]
pub struct Authorize(Option<AsciiMetadataValue>);

impl fmt::Debug for Authorize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Authorize(Bearer …)"
        } else {
            "Authorize(none)"
        })
    }
}

impl Interceptor for Authorize {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// The generated gRPC client over a channel, with the token added to every call.
pub type Grpc = KvIndexerClient<InterceptedService<Channel, Authorize>>;

/// Our admin service's generated client, with the token added to every call.
pub(crate) type AdminClient = kv_indexer_proto::v1::kv_indexer_admin_client::KvIndexerAdminClient<
    InterceptedService<Channel, Authorize>,
>;

impl ClientSecurity {
    /// Reads the files and checks the settings.
    pub fn load(&self) -> Result<Credentials, SecurityError> {
        let authorization = match &self.token {
            None => Authorize(None),
            Some(token) => {
                let token = token.expose();
                if !is_sendable_token(token) {
                    return Err(SecurityError::BadToken);
                }
                let mut value: AsciiMetadataValue = format!("Bearer {token}")
                    .parse()
                    .map_err(|_| SecurityError::BadToken)?;
                // Never indexed by HPACK, and shown redacted.
                value.set_sensitive(true);
                Authorize(Some(value))
            }
        };
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(SecurityError::HalfIdentity);
        }
        let tls_options =
            self.ca_file.is_some() || self.cert_file.is_some() || self.tls_domain.is_some();
        Ok(Credentials {
            #[cfg(feature = "tls")]
            tls: self.tls_config()?,
            tls_options,
            authorization,
        })
    }

    #[cfg(feature = "tls")]
    fn tls_config(&self) -> Result<tonic::transport::ClientTlsConfig, SecurityError> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let mut tls = ClientTlsConfig::new();
        tls = match &self.ca_file {
            Some(path) => tls.ca_certificate(Certificate::from_pem(read_pem(
                "KV_INDEXER_TLS_CA",
                path,
                "CERTIFICATE",
            )?)),
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            let cert = read_pem("KV_INDEXER_CLIENT_CERT", cert, "CERTIFICATE")?;
            let key = read_pem("KV_INDEXER_CLIENT_KEY", key, "PRIVATE KEY")?;
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &self.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        Ok(tls)
    }
}

impl Credentials {
    /// A tonic endpoint for `dial` (an `http://` or `https://` URL, or `unix:path`), with TLS
    /// applied to `https://`.
    pub fn endpoint(&self, dial: &str) -> Result<tonic::transport::Endpoint, SecurityError> {
        let endpoint =
            tonic::transport::Endpoint::from_shared(dial.to_string()).map_err(|source| {
                SecurityError::Address {
                    endpoint: dial.to_string(),
                    source,
                }
            })?;
        let https = dial
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"));
        if !https {
            if self.tls_options {
                return Err(SecurityError::TlsOnPlainEndpoint {
                    endpoint: dial.to_string(),
                });
            }
            return Ok(endpoint);
        }
        #[cfg(feature = "tls")]
        {
            endpoint
                .tls_config(self.tls.clone())
                .map_err(|source| SecurityError::Tls {
                    endpoint: dial.to_string(),
                    source,
                })
        }
        #[cfg(not(feature = "tls"))]
        {
            Ok(endpoint)
        }
    }

    /// The gRPC client over `channel`, with the contract's message limits and the token.
    pub fn client(&self, channel: Channel) -> Grpc {
        KvIndexerClient::new(self.authorized(channel))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// `channel` with the token added to every call, for a call made with a codec of its own
    /// (`tonic::client::Grpc`) rather than through the generated client.
    pub fn authorized(&self, channel: Channel) -> InterceptedService<Channel, Authorize> {
        InterceptedService::new(channel, self.authorization.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(security: &ClientSecurity) -> String {
        security.load().expect_err("must be rejected").to_string()
    }

    #[test]
    fn rejects_a_token_that_is_not_a_header_value() {
        for token in ["", "two words", "line\nbreak", "naïve"] {
            let security = ClientSecurity {
                token: Some(token.into()),
                ..ClientSecurity::default()
            };
            assert!(error(&security).contains("token"), "{token:?}");
        }
    }

    #[test]
    fn never_shows_the_token_in_debug_output() {
        let security = ClientSecurity {
            token: Some("s3cret-token".into()),
            ..ClientSecurity::default()
        };
        let credentials = security.load().unwrap();
        for shown in [format!("{security:?}"), format!("{credentials:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    #[test]
    fn rejects_half_an_identity() {
        let security = ClientSecurity {
            cert_file: Some("client.pem".into()),
            ..ClientSecurity::default()
        };
        assert!(error(&security).contains("give both"));
    }

    #[cfg(feature = "tls")]
    #[test]
    fn names_a_missing_or_empty_file() {
        let missing = ClientSecurity {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..ClientSecurity::default()
        };
        let text = error(&missing);
        assert!(
            text.contains("KV_INDEXER_TLS_CA") && text.contains("/nonexistent/ca.pem"),
            "{text}"
        );
        let not_pem = ClientSecurity {
            ca_file: Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")),
            ..ClientSecurity::default()
        };
        assert!(error(&not_pem).contains("holds no PEM CERTIFICATE"));
    }

    #[test]
    fn tls_options_need_an_https_endpoint() {
        let credentials = ClientSecurity {
            tls_domain: Some("indexer".into()),
            ..ClientSecurity::default()
        }
        .load()
        .unwrap();
        let error = credentials.endpoint("http://[::1]:50051").unwrap_err();
        assert!(error.to_string().contains("is not https://"), "{error}");
        assert!(
            ClientSecurity::default()
                .load()
                .unwrap()
                .endpoint("http://[::1]:50051")
                .is_ok()
        );
    }
}
