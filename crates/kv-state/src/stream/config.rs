//! Where the shared log is and how to reach it: the URL (`redis://`, `rediss://`, or
//! `redis+sentinel://` for a primary that Redis Sentinel names), its key, password, private CA
//! and the Redis replicas an append waits for, checked as settings.

use std::sync::Arc;

use parking_lot::Mutex;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};

/// Where the shared log is and how to reach it.
#[derive(Clone)]
pub struct StreamConfig {
    pub(super) target: Target,
    /// Where the client connects, kept to rebuild it with a CA of its own.
    info: redis::ConnectionInfo,
    /// The URL without credentials, for messages.
    pub(super) url: String,
    pub key: String,
    /// Redis replicas that must hold an append before it counts (`WAIT`; 0: none).
    pub(super) min_replicas: u32,
}

/// How a connection finds Redis.
#[derive(Clone)]
pub(super) enum Target {
    /// One address.
    Direct(Box<redis::Client>),
    /// The primary the sentinels name now, asked at every connection: a replica follows a
    /// failover by reconnecting.
    Sentinel(Arc<Mutex<SentinelClient>>),
}

impl Target {
    /// A client for Redis's primary now.
    pub(super) fn client(&self) -> redis::RedisResult<redis::Client> {
        match self {
            Target::Direct(client) => Ok(client.as_ref().clone()),
            Target::Sentinel(sentinel) => sentinel.lock().get_client(),
        }
    }
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
        "KV_INDEXER_EVENT_LOG (--event-log) {0:?} must be a redis://host:port/db, rediss:// or redis+sentinel://host:port,host:port/<master-name>/<db> URL"
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
    /// The log at `url` (`redis://`, `rediss://` or `redis+sentinel://`), under `key`;
    /// `password`, when given, replaces the URL's.
    pub fn new(
        url: &str,
        key: &str,
        password: Option<&str>,
    ) -> Result<StreamConfig, StreamConfigError> {
        let sentinel = url.strip_prefix("redis+sentinel://");
        if !(url.starts_with("redis://") || url.starts_with("rediss://") || sentinel.is_some()) {
            return Err(StreamConfigError::Scheme(redact(url)));
        }
        if key.is_empty() {
            return Err(StreamConfigError::EmptyKey);
        }
        let bad = |source| StreamConfigError::Url {
            url: redact(url),
            source,
        };
        let (sentinels, master, primary) = match sentinel {
            Some(rest) => {
                let (sentinels, master, primary) =
                    parse_sentinel(rest).ok_or_else(|| StreamConfigError::Scheme(redact(url)))?;
                (sentinels, Some(master), primary)
            }
            None => (Vec::new(), None, url.to_owned()),
        };
        let info =
            redis::IntoConnectionInfo::into_connection_info(primary.as_str()).map_err(bad)?;
        let info = match password {
            Some(password) => {
                let settings = info.redis_settings().clone().set_password(password);
                info.set_redis_settings(settings)
            }
            None => info,
        };
        let target = match master {
            None => Target::Direct(Box::new(redis::Client::open(info.clone()).map_err(bad)?)),
            Some(master) => {
                let node = SentinelNodeConnectionInfo::default()
                    .set_redis_connection_info(info.redis_settings().clone());
                let client = SentinelClient::build(
                    sentinels,
                    master,
                    Some(node),
                    SentinelServerType::Master,
                )
                .map_err(bad)?;
                Target::Sentinel(Arc::new(Mutex::new(client)))
            }
        };
        Ok(StreamConfig {
            target,
            info,
            url: redact(url),
            key: key.to_owned(),
            min_replicas: 0,
        })
    }

    /// Every append waits (`WAIT n`, at most [`super::REPLICA_WAIT`]) until `replicas` Redis replicas
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
        // A sentinel URL is never rediss://, so this is a direct client.
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca_pem),
        };
        let client = redis::Client::build_with_tls(self.info.clone(), certificates)
            .map_err(StreamConfigError::Ca)?;
        self.target = Target::Direct(Box::new(client));
        Ok(self)
    }

    /// Whether an append waits for Redis replicas (`with_min_replicas`).
    pub fn waits_for_replicas(&self) -> bool {
        self.min_replicas > 0
    }
}

/// `[user[:password]@]h1:p1,h2:p2/<master-name>[/<db>]` (after `redis+sentinel://`): the
/// sentinels' URLs, the master's name, and a `redis://` URL with the master's credentials and
/// database (its host is a placeholder: the sentinels name the primary).
fn parse_sentinel(rest: &str) -> Option<(Vec<String>, String, String)> {
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((userinfo, rest)) => (format!("{userinfo}@"), rest),
        None => (String::new(), rest),
    };
    let (hosts, path) = rest.split_once('/')?;
    let (master, db) = match path.split_once('/') {
        Some((master, db)) => (master, db),
        None => (path, "0"),
    };
    let sentinels: Vec<String> = hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("redis://{host}"))
        .collect();
    if sentinels.is_empty() || master.is_empty() || db.parse::<u32>().is_err() {
        return None;
    }
    Some((
        sentinels,
        master.to_owned(),
        format!("redis://{userinfo}primary/{db}"),
    ))
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
        for bad in [
            "redis+sentinel://h:26379",
            "redis+sentinel:///m/0",
            "redis+sentinel://h:1/m/x",
        ] {
            let refused = StreamConfig::new(bad, "k", None).unwrap_err();
            assert!(
                refused.to_string().contains("redis+sentinel://"),
                "{refused}"
            );
        }
    }

    #[test]
    fn a_sentinel_url_names_the_sentinels_the_master_and_the_database() {
        let parsed = parse_sentinel("u:pw@h1:26379,h2:26380/mymaster/3");
        let sentinels = vec!["redis://h1:26379".to_owned(), "redis://h2:26380".to_owned()];
        let want = (
            sentinels,
            "mymaster".to_owned(),
            "redis://u:pw@primary/3".to_owned(),
        );
        assert_eq!(parsed, Some(want));
        assert_eq!(
            parse_sentinel("h1:26379/m").map(|p| p.2),
            Some("redis://primary/0".into())
        );
        let config = StreamConfig::new("redis+sentinel://u:pw@h1:26379/m/0", "k", None).unwrap();
        assert_eq!(config.url(), "redis+sentinel://u:***@h1:26379/m/0");
    }
}
