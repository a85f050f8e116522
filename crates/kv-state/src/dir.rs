//! The state directory (`KV_INDEXER_STATE_DIR`) and its lock: one live server per directory.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("{op} KV_INDEXER_STATE_DIR {path:?}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "KV_INDEXER_STATE_DIR {path:?} is held by another live kv-indexer-server ({holder}); one directory serves one server"
    )]
    Locked { path: PathBuf, holder: String },
    #[error(
        "KV_INDEXER_STATE_DIR {path:?} is not a directory (a directory is created when missing)"
    )]
    NotADirectory { path: PathBuf },
}

/// The state directory, locked for this process until dropped.
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
    _lock: File,
}

impl StateDir {
    /// Creates `path` if needed and takes its lock file (`LOCK`, holding the owner's pid).
    pub fn lock(path: &Path) -> Result<StateDir, DirError> {
        let io = |op| {
            let path = path.to_path_buf();
            move |source| DirError::Io { op, path, source }
        };
        // create_dir_all accepts a directory that exists: "already exists" is something else
        // there (a file), which the OS error alone ("File exists") does not say.
        std::fs::create_dir_all(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::AlreadyExists => DirError::NotADirectory {
                path: path.to_path_buf(),
            },
            _ => io("creating")(source),
        })?;
        let lock_path = path.join("LOCK");
        let mut lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io("opening the lock file of"))?;
        if lock.try_lock().is_err() {
            let holder = std::fs::read_to_string(&lock_path)
                .ok()
                .filter(|s| !s.trim().is_empty())
                .map_or_else(
                    || "pid unknown".to_string(),
                    |pid| format!("pid {}", pid.trim()),
                );
            return Err(DirError::Locked {
                path: path.to_path_buf(),
                holder,
            });
        }
        lock.set_len(0).map_err(io("writing the lock file of"))?;
        writeln!(lock, "{}", std::process::id()).map_err(io("writing the lock file of"))?;
        Ok(StateDir {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves every log segment and snapshot aside into `corrupt-<unix ms>/`, so that the
    /// server can start empty while the bad files stay for a post-mortem; returns that folder.
    pub fn set_aside(&self, now_ms: u64) -> Result<PathBuf, DirError> {
        let aside = self.path.join(format!("corrupt-{now_ms}"));
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| DirError::Io { op, path, source }
        };
        std::fs::create_dir_all(&aside).map_err(io("creating", &aside))?;
        for entry in std::fs::read_dir(&self.path).map_err(io("listing", &self.path))? {
            let entry = entry.map_err(io("listing", &self.path))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".seg") || name.ends_with(".snap") || name.ends_with(".tmp") {
                std::fs::rename(entry.path(), aside.join(&*name))
                    .map_err(io("moving aside", &entry.path()))?;
            }
        }
        Ok(aside)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_is_refused_naming_the_holder() {
        let path = std::env::temp_dir().join(format!("kv-dir-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let held = StateDir::lock(&path).unwrap();
        let error = StateDir::lock(&path).unwrap_err().to_string();
        assert!(
            error.contains("held by another live kv-indexer-server"),
            "{error}"
        );
        assert!(
            error.contains(&format!("pid {}", std::process::id())),
            "{error}"
        );
        drop(held);
        StateDir::lock(&path).unwrap();
    }

    #[test]
    fn a_file_is_refused_as_not_a_directory() {
        let path = std::env::temp_dir().join(format!("kv-dir-file-{}", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let error = StateDir::lock(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(
            error.contains("KV_INDEXER_STATE_DIR") && error.contains("is not a directory"),
            "{error}"
        );
    }
}
