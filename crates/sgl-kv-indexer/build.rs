//! Sets `KV_INDEXER_COMMIT` for the binaries' `--version` and `kv_indexer_build_info`: the
//! variable of that name when the build sets it (a build from a source archive, or an image
//! built without `.git`), else `git rev-parse --short=12 HEAD` of the checkout, else `unknown`.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-env-changed=KV_INDEXER_COMMIT");
    let commit = std::env::var("KV_INDEXER_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo::rustc-env=KV_INDEXER_COMMIT={}", commit.trim());
}

/// The checkout's commit, and a rerun whenever HEAD moves (a commit or a checkout writes the
/// HEAD reflog).
fn git_commit() -> Option<String> {
    let git_dir = git(&["rev-parse", "--git-dir"])?;
    let git_dir = Path::new(&git_dir);
    for watched in ["HEAD", "logs/HEAD"] {
        let path = git_dir.join(watched);
        if path.exists() {
            println!("cargo::rerun-if-changed={}", path.display());
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}

fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let output = Command::new("git")
        .args(args)
        .current_dir(&dir)
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?.trim().to_string();
    // `--git-dir` may answer a path relative to the directory it ran in.
    let path = Path::new(&text);
    if args[1] == "--git-dir" && path.is_relative() {
        return Some(Path::new(&dir).join(path).display().to_string());
    }
    Some(text)
}
