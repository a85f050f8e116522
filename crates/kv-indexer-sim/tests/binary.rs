//! The `kv-indexer-sim` binary: a bad setting stops it naming the flag; it prints its endpoints,
//! serves, and exits cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn exits_non_zero_naming_a_bad_setting() {
    let output = Command::new(env!("CARGO_BIN_EXE_kv-indexer-sim"))
        .env("KV_INDEXER_SIM_PAGE_SIZE", "0")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--page-size"), "{stderr}");
}

/// The value of `key=` in the endpoints line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

#[test]
fn prints_its_endpoints_serves_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-indexer-sim"))
        .args(["--port", "0", "--kv-events-port", "0", "--replay-port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("kv-indexer-sim "), "{line:?}");
    assert!(
        field(&line, "kv_events").starts_with("tcp://127.0.0.1:"),
        "{line}"
    );
    assert!(
        field(&line, "replay").starts_with("tcp://127.0.0.1:"),
        "{line}"
    );
    let http = field(&line, "http")
        .trim_start_matches("http://")
        .to_string();

    let mut stream = TcpStream::connect(&http).unwrap();
    write!(
        stream,
        "GET /health HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("still running 20 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}
