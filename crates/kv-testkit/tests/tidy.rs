//! The repository's own rules, checked on its files under `cargo test` (as rust-analyzer's
//! `xtask` tidy test does), each failure naming the file and line:
//!
//! - no production function over 80 lines (`crates/*/src`, outside `#[cfg(test)]` modules);
//! - no production file over 850 lines, none in `kv-state` over 700;
//! - `ARCHITECTURE.md` under 250 lines: a map, the design essays live in `docs/`;
//! - each file's imports in three runs: `std`/`core`/`alloc`, then other crates, then this
//!   crate's (`crate::`, `self::`, `super::`, or a module the file declares).
//!
//! Import circles between a crate's files are `scripts/import_cycles.py`'s (run by `.ci/run`).
//! Brace counting ignores strings and comments well enough for rustfmt-formatted code.

use std::path::{Path, PathBuf};

const MAX_FUNCTION_LINES: usize = 80;
const MAX_FILE_LINES: usize = 850;
const MAX_KV_STATE_FILE_LINES: usize = 700;
const MAX_ARCHITECTURE_LINES: usize = 250;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `crates/*/src`, with its path relative to the root.
fn production_files() -> Vec<(String, String)> {
    let mut files = Vec::new();
    let crates = root().join("crates");
    for entry in std::fs::read_dir(&crates).unwrap() {
        collect(&entry.unwrap().path().join("src"), &mut files);
    }
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path
                .strip_prefix(root())
                .unwrap_or(&path)
                .display()
                .to_string();
            (name, text)
        })
        .collect()
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// `line` without string and char literals and without its `//` comment.
fn code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
                out.push_str("\"\"");
            }
            '\'' if matches!(chars.clone().nth(1), Some('\'')) => {
                chars.next();
                chars.next();
                out.push_str("''");
            }
            '/' if chars.peek() == Some(&'/') => break,
            c => out.push(c),
        }
    }
    out
}

fn braces(line: &str) -> isize {
    line.matches('{').count() as isize - line.matches('}').count() as isize
}

/// Whether `line` starts a function (not a declaration ending in `;`).
fn starts_fn(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace().peekable();
    while let Some(word) = words.peek() {
        if word.starts_with("pub") || ["const", "async", "unsafe", "extern"].contains(word) {
            words.next();
        } else {
            break;
        }
    }
    if words.next() != Some("fn") || line.trim_end().ends_with(';') {
        return None;
    }
    let name = words.next()?;
    Some(name.split(['(', '<']).next().unwrap_or(name))
}

/// Each production function of `text` over `max` lines: (line, name, length).
fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let lines: Vec<String> = text.lines().map(code).collect();
    let raw: Vec<&str> = text.lines().collect();
    let (mut depth, mut test_depth) = (0isize, None);
    let mut over = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if raw[i].trim_start().starts_with("#[cfg(test)]") && test_depth.is_none() {
            test_depth = Some(depth);
        }
        let name = starts_fn(&lines[i]).filter(|_| test_depth.is_none());
        if let Some(name) = name {
            let (start, fn_depth) = (i, depth);
            let mut opened = false;
            while i < lines.len() {
                depth += braces(&lines[i]);
                opened |= lines[i].contains('{');
                if (opened && depth <= fn_depth) || (!opened && lines[i].trim_end().ends_with(';'))
                {
                    break;
                }
                i += 1;
            }
            let length = i - start + 1;
            if length > max {
                over.push((start + 1, name.to_owned(), length));
            }
            i += 1;
            continue;
        }
        depth += braces(&lines[i]);
        if test_depth.is_some_and(|d| depth <= d) && lines[i].contains('}') {
            test_depth = None;
        }
        i += 1;
    }
    over
}

#[test]
fn no_production_function_is_over_80_lines() {
    let mut over = Vec::new();
    for (name, text) in production_files() {
        for (line, function, length) in long_functions(&text, MAX_FUNCTION_LINES) {
            over.push(format!("{name}:{line} {function}: {length} lines"));
        }
    }
    assert!(over.is_empty(), "split these:\n{}", over.join("\n"));
}

#[test]
fn the_counter_sees_a_long_function_and_skips_test_modules() {
    let body = "    let x = 1;\n".repeat(81);
    let text = format!(
        "fn long() {{\n{body}}}\n#[cfg(test)]\nmod tests {{\n    fn also_long() {{\n{body}    }}\n}}\nfn short() {{}}\n"
    );
    assert_eq!(long_functions(&text, 80), [(1, "long".to_owned(), 83)]);
    // Counted as a brace, the `'{'` would run the first function to the end of the text.
    let text = "pub(crate) async fn f(s: &str) -> char {\n    '{'\n}\nfn g() {}\nfn h() {\n}\n";
    assert!(
        long_functions(text, 3).is_empty(),
        "a brace in a char literal"
    );
    assert_eq!(long_functions(text, 2), [(1, "f".to_owned(), 3)]);
}

#[test]
fn no_production_file_is_too_long() {
    let mut over = Vec::new();
    for (name, text) in production_files() {
        let bound = match name.contains("crates/kv-state/") {
            true => MAX_KV_STATE_FILE_LINES,
            false => MAX_FILE_LINES,
        };
        let lines = text.lines().count();
        if lines > bound {
            over.push(format!("{name}: {lines} lines (bound {bound})"));
        }
    }
    assert!(over.is_empty(), "split these:\n{}", over.join("\n"));
}

#[test]
fn architecture_md_stays_a_map() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines < MAX_ARCHITECTURE_LINES,
        "ARCHITECTURE.md has {lines} lines (bound {MAX_ARCHITECTURE_LINES}): move design essays to docs/"
    );
}

/// The run of an import: 0 the standard library, 1 another crate, 2 this crate.
fn import_run(line: &str, local_modules: &[String]) -> Option<u8> {
    let path = line.strip_prefix("use ")?.trim_start_matches("::");
    let root = path.split([':', ';', ' ', '{']).next()?;
    Some(match root {
        "std" | "core" | "alloc" => 0,
        "crate" | "self" | "super" => 2,
        _ if local_modules.iter().any(|m| m == root) => 2,
        _ => 1,
    })
}

/// The modules `text` declares (`mod x;`, `pub mod x;`, `mod x {`).
fn declared_modules(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let rest = line.strip_prefix("mod ").or_else(|| {
                let (_, after) = line.split_once(" mod ")?;
                line.starts_with("pub").then_some(after)
            })?;
            Some(rest.trim_end_matches([';', '{', ' ']).to_owned())
        })
        .collect()
}

/// The imports of `text`'s header out of order: (line, the import).
fn misordered_imports(text: &str) -> Vec<(usize, String)> {
    let local = declared_modules(text);
    let mut highest = 0;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some(run) = import_run(line, &local) else {
            continue;
        };
        if run < highest {
            out.push((i + 1, line.to_owned()));
        }
        highest = highest.max(run);
    }
    out
}

#[test]
fn imports_go_std_then_other_crates_then_this_crate() {
    let mut out = Vec::new();
    for (name, text) in production_files() {
        for (line, import) in misordered_imports(&text) {
            out.push(format!("{name}:{line}: {import}"));
        }
    }
    assert!(
        out.is_empty(),
        "move these up to their run:\n{}",
        out.join("\n")
    );
}

#[test]
fn the_import_check_sees_a_std_import_after_another_crate() {
    let text =
        "mod local;\nuse std::fmt;\nuse tokio::sync;\nuse local::X;\nuse crate::y;\nuse std::io;\n";
    assert_eq!(misordered_imports(text), [(6, "use std::io;".to_owned())]);
}
