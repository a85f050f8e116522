//! Secret settings and the files they come from: a [`Secret`] never prints, a token is checked
//! by one rule on both sides, and a PEM file is checked for the block it must hold.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A token or other secret setting: its `Debug` shows nothing, so that no `{:?}` of a
/// configuration can log it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for the one place that sends or checks it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(value: &str) -> Result<Secret, Self::Err> {
        Ok(Secret(value.to_string()))
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Secret {
        Secret(value.to_string())
    }
}

/// Whether `token` can travel as `authorization: Bearer <token>`: not empty, visible ASCII, no
/// spaces. The one rule for clients and server alike.
pub fn is_sendable_token(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic())
}

/// A PEM setting that cannot be used, naming the setting and the file.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("reading {what} {path:?}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path:?} holds no PEM {expected}")]
    NotPem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
}

/// Reads a PEM file, checking that it holds at least one block of the `expected` kind (any
/// `… PRIVATE KEY` label counts for keys). `what` names the setting in the error.
pub fn read_pem(
    what: &'static str,
    path: &Path,
    expected: &'static str,
) -> Result<Vec<u8>, PemError> {
    let bytes = std::fs::read(path).map_err(|source| PemError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("-----BEGIN "))
        .any(|label| label.trim_end_matches('-').ends_with(expected));
    if !found {
        return Err(PemError::NotPem {
            what,
            path: path.to_path_buf(),
            expected,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_debug_hides_the_value() {
        assert_eq!(format!("{:?}", Secret::from("hunter2")), "Secret(…)");
    }

    #[test]
    fn sendable_tokens_are_visible_ascii_without_spaces() {
        for (token, sendable) in [("abc-123", true), ("", false), ("a b", false), ("é", false)] {
            assert_eq!(is_sendable_token(token), sendable, "{token:?}");
        }
    }
}
