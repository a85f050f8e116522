//! What the five binaries share: the version they report (`--version`) and export
//! (`kv_indexer_build_info`). The binaries themselves are thin mains over their libraries.

use clap::{CommandFactory, FromArgMatches};

/// The package's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binaries were built from (`build.rs`), or `unknown`.
pub const COMMIT: &str = env!("KV_INDEXER_COMMIT");

/// `--version`'s answer: the version and the commit.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("KV_INDEXER_COMMIT"),
    ")"
);

/// Parses the command line as `A::parse` does, with [`LONG_VERSION`] as the version (the
/// settings structs live in libraries whose own version is not the release's), and an error
/// about a flag also names the environment variable it reads, since that is how most
/// deployments set it.
pub fn parse_args<A: CommandFactory + FromArgMatches>() -> A {
    parse_command(A::command())
}

/// [`parse_args`], with `about` as the first line of `--help`: the settings structs live in
/// libraries, whose `about` describes the library (its package description), not the binary
/// the user runs.
pub fn parse_args_about<A: CommandFactory + FromArgMatches>(about: &'static str) -> A {
    parse_command(A::command().about(about).long_about(None))
}

/// The command line parsed by `command`, as [`parse_args`] says.
fn parse_command<A: FromArgMatches>(command: clap::Command) -> A {
    let empty = |name: &std::ffi::OsStr| std::env::var_os(name).is_some_and(|v| v.is_empty());
    let mut command = ignore_empty_variables(command.version(LONG_VERSION), &empty);
    let parsed = command
        .try_get_matches_from_mut(std::env::args_os())
        .and_then(|matches| A::from_arg_matches(&matches));
    parsed.unwrap_or_else(|error| name_variables(error, &command).exit())
}

/// `command` with each variable `is_empty` says is set but empty (`KV_INDEXER_STATE_DIR=`, as
/// a container or a compose file's `${VAR:-}` sets it) treated as unset: its default applies,
/// where clap would refuse the empty value.
pub fn ignore_empty_variables(
    mut command: clap::Command,
    is_empty: &dyn Fn(&std::ffi::OsStr) -> bool,
) -> clap::Command {
    let ids: Vec<clap::Id> = command
        .get_arguments()
        .filter(|arg| arg.get_env().is_some_and(is_empty))
        .map(|arg| arg.get_id().clone())
        .collect();
    for id in ids {
        command = command.mut_arg(id, |arg| arg.env(None));
    }
    let subcommands: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_string())
        .collect();
    for name in subcommands {
        command = command.mut_subcommand(name, |sub| ignore_empty_variables(sub, is_empty));
    }
    command
}

/// `error` with the variable beside each flag it names:
/// `'--heartbeat-ms <HEARTBEAT_MS> (KV_INDEXER_HEARTBEAT_MS)'`.
pub fn name_variables(mut error: clap::Error, command: &clap::Command) -> clap::Error {
    use clap::error::{ContextKind, ContextValue};
    let named = |shown: &String| {
        let flag = shown.split([' ', '=']).next().unwrap_or_default();
        match find_arg(command, flag).and_then(clap::Arg::get_env) {
            Some(variable) => format!("{shown} ({})", variable.to_string_lossy()),
            None => shown.clone(),
        }
    };
    let value = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(shown)) => ContextValue::String(named(shown)),
        Some(ContextValue::Strings(shown)) => {
            ContextValue::Strings(shown.iter().map(named).collect())
        }
        _ => return error,
    };
    error.insert(ContextKind::InvalidArg, value);
    error
}

/// The argument whose long flag is `flag` (`--name`), in `command` or a subcommand.
fn find_arg<'c>(command: &'c clap::Command, flag: &str) -> Option<&'c clap::Arg> {
    let long = flag.strip_prefix("--")?;
    command
        .get_arguments()
        .find(|arg| arg.get_long() == Some(long))
        .or_else(|| {
            command
                .get_subcommands()
                .find_map(|sub| find_arg(sub, flag))
        })
}

/// A main's exit: 0, or 1 after printing `error: ` and the error with its causes on one line
/// (`{:#}`), without the backtrace anyhow's own report adds when RUST_BACKTRACE is set (a bad
/// setting is not a bug).
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Exports `kv_indexer_build_info{version,commit} 1` to the installed recorder.
pub fn export_build_info() {
    metrics::describe_gauge!(
        "kv_indexer_build_info",
        "1, labelled with the running binary's version and the commit it was built from"
    );
    metrics::gauge!("kv_indexer_build_info", "version" => VERSION, "commit" => COMMIT).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct StateConfig {
        #[arg(long, env = "KV_TEST_HEARTBEAT_MS", default_value = "5")]
        heartbeat_ms: std::num::NonZeroU64,
        #[arg(long)]
        plain: Option<u64>,
    }

    #[test]
    fn errors_about_a_flag_name_its_variable() {
        let cases: &[(&[&str], &str)] = &[
            (&["--heartbeat-ms", "0"], "(KV_TEST_HEARTBEAT_MS)"),
            (&["--heartbeat-ms", "x"], "(KV_TEST_HEARTBEAT_MS)"),
            (&["--plain", "x"], "'--plain <PLAIN>'"),
        ];
        for (argv, needle) in cases {
            let mut command = StateConfig::command();
            let error = command
                .try_get_matches_from_mut(std::iter::once(&"t").chain(argv.iter()))
                .and_then(|matches| StateConfig::from_arg_matches(&matches))
                .expect_err("must be refused");
            let text = name_variables(error, &command).to_string();
            assert!(text.contains(needle), "{argv:?}: {text}");
        }
    }
}
