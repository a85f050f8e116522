//! Where the shared log is and how to reach it: the URL (`redis://`, `rediss://`), its key,
//! password, private CA and the Redis replicas an append waits for, checked as settings.

/// Where the shared log is and how to reach it.
#[derive(Clone)]
pub struct StreamConfig {
    pub(super) client: redis::Client,
    /// Where the client connects, kept to rebuild it with a CA of its own.
    info: redis::ConnectionInfo,
    /// The URL without credentials, for messages.
    pub(super) url: String,
    pub key: String,
    /// Redis replicas that must hold an append before it counts (`WAIT`; 0: none).
    pub(super) min_replicas: u32,
}

impl std::fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConfig")
            .field("url", &self.url)
            .field("key", &self.key)
            .finish()
    }
}

/// Why an event-log setting is refused.
#[derive(Debug, thiserror::Error)]
pub enum StreamConfigError {
    #[error(
        "KV_INDEXER_EVENT_LOG (--event-log) {0:?} must be a redis://host:port/db or rediss:// URL"
    )]
    Scheme(String),
    #[error("KV_INDEXER_EVENT_LOG (--event-log) {url:?} does not parse")]
    Url {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("KV_INDEXER_EVENT_LOG_KEY (--event-log-key) must not be empty")]
    EmptyKey,
    #[error(
        "KV_INDEXER_EVENT_LOG_TLS_CA (--event-log-tls-ca) needs a rediss:// KV_INDEXER_EVENT_LOG"
    )]
    CaWithoutTls,
    #[error("KV_INDEXER_EVENT_LOG_TLS_CA (--event-log-tls-ca) cannot be used")]
    Ca(#[source] redis::RedisError),
}

impl StreamConfig {
    /// The log at `url` (`redis://` or `rediss://`), under `key`; `password`, when given,
    /// replaces the URL's.
    pub fn new(
        url: &str,
        key: &str,
        password: Option<&str>,
    ) -> Result<StreamConfig, StreamConfigError> {
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            return Err(StreamConfigError::Scheme(redact(url)));
        }
        if key.is_empty() {
            return Err(StreamConfigError::EmptyKey);
        }
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|source| {
            StreamConfigError::Url {
                url: redact(url),
                source,
            }
        })?;
        let info = match password {
            Some(password) => {
                let settings = info.redis_settings().clone().set_password(password);
                info.set_redis_settings(settings)
            }
            None => info,
        };
        let client =
            redis::Client::open(info.clone()).map_err(|source| StreamConfigError::Url {
                url: redact(url),
                source,
            })?;
        Ok(StreamConfig {
            client,
            info,
            url: redact(url),
            key: key.to_owned(),
            min_replicas: 0,
        })
    }

    /// Every append waits (`WAIT n`, at most [`REPLICA_WAIT`]) until `replicas` Redis replicas
    /// hold it, and fails when fewer do: an acknowledged change then survives a failover to any
    /// of them (Redis replicates asynchronously, so without it a failover may drop the last
    /// acknowledged appends).
    pub fn with_min_replicas(mut self, replicas: u32) -> StreamConfig {
        self.min_replicas = replicas;
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// A `rediss://` log whose server certificate `ca_pem` (PEM) signs, instead of the system's
    /// roots: a private CA, as engines inside a cluster often have.
    pub fn with_tls_ca(mut self, ca_pem: Vec<u8>) -> Result<StreamConfig, StreamConfigError> {
        if !self.url.starts_with("rediss://") {
            return Err(StreamConfigError::CaWithoutTls);
        }
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca_pem),
        };
        self.client = redis::Client::build_with_tls(self.info.clone(), certificates)
            .map_err(StreamConfigError::Ca)?;
        Ok(self)
    }

    /// Whether an append waits for Redis replicas (`with_min_replicas`).
    pub fn waits_for_replicas(&self) -> bool {
        self.min_replicas > 0
    }
}

/// `url` with any password replaced by `***`.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_name_the_problem() {
        let refused = StreamConfig::new("http://localhost:6379", "k", None).unwrap_err();
        assert!(refused.to_string().contains("KV_INDEXER_EVENT_LOG"));
        let refused = StreamConfig::new("redis://localhost:6379", "", None).unwrap_err();
        assert!(refused.to_string().contains("KV_INDEXER_EVENT_LOG_KEY"));
        let refused = StreamConfig::new("redis://u:secret@[bad", "k", None).unwrap_err();
        let text = refused.to_string();
        assert!(
            text.contains("does not parse") && !text.contains("secret"),
            "{text}"
        );
        let config = StreamConfig::new("redis://u:secret@localhost:6379/2", "k", None).unwrap();
        assert_eq!(config.url(), "redis://u:***@localhost:6379/2");
    }
}
