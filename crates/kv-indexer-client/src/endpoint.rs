//! The Indexer endpoint list: `http://host[:port]`, `https://host[:port]` or `unix:path`,
//! comma-separated, one entry per replica, tried in order.
//!
//! Anything that could never be dialed is rejected here, once, at start-up, with the bad entry
//! named, rather than on every query: bad URL syntax, a missing host, port 0, a path or query
//! (gRPC ignores them, so they are a mistake), any other scheme, `https://` in a build without
//! TLS. `unix:` follows gRPC's naming: `unix:path` (relative or absolute) or `unix:///abs/path`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use http::Uri;

/// One replica's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `http://` (plain HTTP/2) or `https://` (TLS), always with a host; `uri` is normalised
    /// to scheme and authority.
    Url { uri: Uri, tls: bool },
    /// A unix domain socket.
    Unix { path: PathBuf },
}

/// A rejected endpoint list; every variant but [`EndpointError::Empty`] names the bad entry.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("no Indexer endpoint given")]
    Empty,
    #[error("endpoint list {list:?}: entry {position} is empty")]
    EmptyEntry { list: String, position: usize },
    #[error("endpoint {entry:?}: expected http://host:port, https://host:port or unix:path")]
    NoScheme { entry: String },
    #[error("endpoint {entry:?}: unsupported scheme {scheme:?} (use http, https or unix)")]
    UnsupportedScheme { entry: String, scheme: String },
    #[error("endpoint {entry:?}: not a valid URL")]
    BadSyntax {
        entry: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("endpoint {entry:?}: no host")]
    NoHost { entry: String },
    #[error("endpoint {entry:?}: bad port")]
    BadPort { entry: String },
    #[error("endpoint {entry:?}: a gRPC endpoint has no path or query")]
    HasPath { entry: String },
    #[error("endpoint {entry:?}: no socket path")]
    NoSocketPath { entry: String },
    #[error("endpoint {entry:?}: after unix:// the socket path must be absolute (unix:///path)")]
    RelativeAfterSlashes { entry: String },
    #[error("endpoint {entry:?}: https needs TLS, which this build leaves out")]
    TlsNotBuilt { entry: String },
}

impl Endpoint {
    /// Parses one entry (surrounding whitespace ignored).
    pub fn parse(entry: &str) -> Result<Endpoint, EndpointError> {
        let entry = entry.trim();
        let owned = || entry.to_string();
        if let Some(rest) = entry.strip_prefix("unix:") {
            let path = match rest.strip_prefix("//") {
                Some(path) if !path.starts_with('/') => {
                    return Err(EndpointError::RelativeAfterSlashes { entry: owned() });
                }
                Some(path) => path,
                None => rest,
            };
            if path.is_empty() {
                return Err(EndpointError::NoSocketPath { entry: owned() });
            }
            return Ok(Endpoint::Unix { path: path.into() });
        }
        let Some((scheme, _)) = entry.split_once("://") else {
            return Err(EndpointError::NoScheme { entry: owned() });
        };
        let tls = match scheme.to_ascii_lowercase().as_str() {
            "http" => false,
            "https" if cfg!(feature = "tls") => true,
            "https" => return Err(EndpointError::TlsNotBuilt { entry: owned() }),
            _ => {
                return Err(EndpointError::UnsupportedScheme {
                    entry: owned(),
                    scheme: scheme.to_string(),
                });
            }
        };
        let uri: Uri = entry.parse().map_err(|source| EndpointError::BadSyntax {
            entry: owned(),
            source,
        })?;
        let Some(authority) = uri.authority() else {
            return Err(EndpointError::NoHost { entry: owned() });
        };
        if authority.host().is_empty() {
            return Err(EndpointError::NoHost { entry: owned() });
        }
        // A port that does not fit u16, or 0, can never be dialed.
        let port = authority
            .as_str()
            .rsplit_once(':')
            .filter(|(_, after)| !after.contains(']'))
            .map(|(_, port)| port.parse::<u16>());
        if matches!(port, Some(Err(_) | Ok(0))) {
            return Err(EndpointError::BadPort { entry: owned() });
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(EndpointError::HasPath { entry: owned() });
        }
        let uri = Uri::builder()
            .scheme(if tls { "https" } else { "http" })
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|_| EndpointError::NoHost { entry: owned() })?;
        Ok(Endpoint::Url { uri, tls })
    }

    /// Parses a comma-separated list of replicas, in the order they are tried.
    pub fn parse_list(list: &str) -> Result<Vec<Endpoint>, EndpointError> {
        if list.trim().is_empty() {
            return Err(EndpointError::Empty);
        }
        list.split(',')
            .enumerate()
            .map(|(i, entry)| {
                if entry.trim().is_empty() {
                    Err(EndpointError::EmptyEntry {
                        list: list.to_string(),
                        position: i + 1,
                    })
                } else {
                    Endpoint::parse(entry)
                }
            })
            .collect()
    }

    /// The string tonic's `Endpoint::from_shared` takes.
    pub(crate) fn dial_string(&self) -> String {
        match self {
            Endpoint::Url { uri, .. } => {
                let authority = uri.authority().map_or("", |a| a.as_str());
                let scheme = uri.scheme_str().unwrap_or("http");
                format!("{scheme}://{authority}")
            }
            Endpoint::Unix { path } => format!("unix:{}", path.display()),
        }
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(entry: &str) -> Result<Endpoint, EndpointError> {
        Endpoint::parse(entry)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.dial_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Ok`: the replicas' display forms; `Err`: a text the error must contain.
    fn check(list: &str, expect: Result<&[&str], &str>) {
        match (Endpoint::parse_list(list), expect) {
            (Ok(endpoints), Ok(want)) => {
                let got: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
                assert_eq!(got, want, "list {list:?}");
            }
            (Err(error), Err(needle)) => {
                let text = error.to_string();
                assert!(text.contains(needle), "{list:?}: {text:?} lacks {needle:?}");
            }
            (got, want) => panic!("list {list:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn accepts_http_urls_with_a_host() {
        check("http://[::1]:50051", Ok(&["http://[::1]:50051"]));
        check("http://127.0.0.1:50051/", Ok(&["http://127.0.0.1:50051"]));
        check("http://indexer", Ok(&["http://indexer"]));
        check("HTTP://indexer:1", Ok(&["http://indexer:1"]));
        check("  http://indexer:1  ", Ok(&["http://indexer:1"]));
    }

    #[cfg(feature = "tls")]
    #[test]
    fn accepts_https_urls() {
        check(
            "https://indexer.example:443",
            Ok(&["https://indexer.example:443"]),
        );
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn rejects_https_without_tls() {
        check(
            "https://indexer:443",
            Err("\"https://indexer:443\": https needs TLS"),
        );
    }

    #[test]
    fn accepts_unix_sockets_as_grpc_names_them() {
        check("unix:/run/indexer.sock", Ok(&["unix:/run/indexer.sock"]));
        check("unix:indexer.sock", Ok(&["unix:indexer.sock"]));
        check("unix:///run/indexer.sock", Ok(&["unix:/run/indexer.sock"]));
    }

    #[test]
    fn keeps_replicas_in_order() {
        check(
            "http://a:1, http://b:2,unix:/c",
            Ok(&["http://a:1", "http://b:2", "unix:/c"]),
        );
    }

    #[test]
    fn rejects_what_can_never_be_dialed_naming_the_entry() {
        for (list, needle) in [
            ("", "no Indexer endpoint"),
            ("   ", "no Indexer endpoint"),
            ("http://a:1,,http://b:2", "entry 2 is empty"),
            ("http://a:1,", "entry 2 is empty"),
            ("[::1]:50051", "\"[::1]:50051\": expected http://"),
            ("localhost:50051", "\"localhost:50051\": expected http://"),
            ("grpc://a:1", "unsupported scheme \"grpc\""),
            ("tcp://a:1", "unsupported scheme \"tcp\""),
            ("http://a:1,ftp://b", "\"ftp://b\": unsupported scheme"),
            ("http://", "\"http://\""),
            ("http://:50051", "\"http://:50051\": no host"),
            ("http://a b:1", "not a valid URL"),
            ("http://a:0", "\"http://a:0\": bad port"),
            ("http://a:65536", "\"http://a:65536\""),
            ("http://a:port", "\"http://a:port\""),
            (
                "http://a:1/kv",
                "\"http://a:1/kv\": a gRPC endpoint has no path",
            ),
            ("http://a:1?x=1", "no path or query"),
            ("unix:", "\"unix:\": no socket path"),
            ("unix://", "\"unix://\""),
            ("unix://indexer.sock", "must be absolute"),
        ] {
            check(list, Err(needle));
        }
    }
}
