//! The shipped binaries as an operator meets them: `--version`, a start-up that fails before it
//! says it listens, and `/metrics` with help texts and every series from start; the simulated
//! worker's endpoints line and its clean stop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kv_testkit::Port;

#[test]
fn every_binary_reports_its_version_and_commit() {
    let binaries = [
        env!("CARGO_BIN_EXE_kv-indexer-server"),
        env!("CARGO_BIN_EXE_kv-indexer-bridge"),
        env!("CARGO_BIN_EXE_kv-indexer-ctl"),
        env!("CARGO_BIN_EXE_kv-indexer-router"),
        env!("CARGO_BIN_EXE_kv-indexer-sim"),
    ];
    let expected = format!(
        "{} (commit {})",
        env!("CARGO_PKG_VERSION"),
        sgl_kv_indexer::COMMIT
    );
    assert!(!sgl_kv_indexer::COMMIT.is_empty());
    for binary in binaries {
        let output = std::process::Command::new(binary)
            .arg("--version")
            .output()
            .unwrap();
        assert!(output.status.success(), "{binary}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(stdout.trim_end().ends_with(&expected), "{binary}: {stdout}");
    }
}

/// A state directory that cannot be created fails start-up naming the variable, before the
/// server says it listens.
#[test]
fn a_bad_state_directory_fails_before_listening() {
    let file = kv_testkit::temp_dir("kv-binaries", "state-file");
    std::fs::create_dir_all(&file).unwrap();
    let file = file.join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    let port = Port::reserve();
    let state = file.join("state");
    let output = server(&[
        ("KV_INDEXER_LISTEN_ADDR", &port.addr().to_string()),
        ("KV_INDEXER_STATE_DIR", state.to_str().unwrap()),
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("KV_INDEXER_STATE_DIR"), "{stderr}");
    assert!(
        !stderr.contains("listening"),
        "said it listens first: {stderr}"
    );
}

/// The server's `/metrics` right after start: every metric has its `# HELP`, the ones dashboards
/// and alerts use are there before any event, durations are in seconds. Its optional settings
/// are set but empty, as a container or a compose file's `${VAR:-}` sets them: unset, not
/// refused.
#[test]
fn metrics_have_help_and_exist_from_start() {
    let (grpc, admin) = (Port::reserve(), Port::reserve());
    let (grpc_addr, admin_addr) = (grpc.addr(), admin.addr());
    drop((grpc, admin));
    let mut server = server(&[
        ("KV_INDEXER_LISTEN_ADDR", &grpc_addr.to_string()),
        ("KV_INDEXER_METRICS_ADDR", &admin_addr.to_string()),
        ("KV_INDEXER_STATE_DIR", ""),
        ("KV_INDEXER_EVENT_LOG", ""),
        ("KV_INDEXER_WRITE_TOKEN", ""),
    ])
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        match scrape(admin_addr) {
            Some(text) if text.contains("kv_indexer_serving 1") => break text,
            _ if Instant::now() > deadline => panic!("no SERVING metrics within 20 s"),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    server.kill().unwrap();
    let _ = server.wait();
    let declared: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    for name in &declared {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no help"
        );
        assert!(!name.ends_with("_ms"), "{name}: durations are in seconds");
    }
    for name in [
        "kv_indexer_build_info",
        "kv_indexer_serving",
        "kv_indexer_requests_total",
        "kv_indexer_rejections_total",
        "kv_indexer_prefix_queries_inflight",
        "kv_indexer_workers",
        "kv_indexer_snapshot_failures_total",
        "kv_indexer_snapshot_last_success_timestamp_seconds",
        "kv_indexer_fleet_lag_seconds",
        "kv_indexer_sequence_gaps_total",
        "kv_indexer_state_unwritable",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(declared.contains(&name), "{name} missing at start:\n{text}");
    }
    // The process's own figures are read, not exported as zeros.
    let resident = metric(&text, "process_resident_memory_bytes").unwrap();
    assert!(resident > 1e6, "resident memory {resident}");
    assert!(metric(&text, "process_open_fds").unwrap() > 3.0);
}

/// A replica whose Redis goes away: `kv_indexer_fleet_lag_seconds` rises with the lag (it
/// used to stay at its last read's value) and `kv_indexer_serving` drops to 0, while the
/// outage is logged at the 1st, 2nd, 4th, … failed attempt, not at each one (4 a second).
#[test]
fn a_replica_cut_off_from_its_log_shows_the_lag_and_logs_the_outage_sparingly() {
    let Some(mut redis) = kv_testkit::redis::RedisServer::start(false) else {
        return;
    };
    let (grpc, admin) = (Port::reserve(), Port::reserve());
    let (grpc_addr, admin_addr) = (grpc.addr(), admin.addr());
    drop((grpc, admin));
    let logs = kv_testkit::temp_dir("kv-binaries", "replica-log").with_extension("log");
    let mut server = server(&[
        ("KV_INDEXER_LISTEN_ADDR", &grpc_addr.to_string()),
        ("KV_INDEXER_METRICS_ADDR", &admin_addr.to_string()),
        ("KV_INDEXER_EVENT_LOG", &redis.url()),
    ])
    .stderr(std::fs::File::create(&logs).unwrap())
    .spawn()
    .unwrap();
    wait_for(admin_addr, "SERVING", &|text| {
        metric(text, "kv_indexer_serving") == Some(1.0)
    });
    redis.kill();
    let down = Instant::now();
    let text = wait_for(admin_addr, "the lag past 2 s", &|text| {
        metric(text, "kv_indexer_fleet_lag_seconds").is_some_and(|lag| lag > 2.0)
    });
    assert_eq!(metric(&text, "kv_indexer_serving"), Some(0.0), "{text}");
    // At least 4 s of outage, retried every 250 ms at most: 16 or more failed attempts.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(down.elapsed()));
    server.kill().unwrap();
    let _ = server.wait();
    let log = std::fs::read_to_string(&logs).unwrap();
    let lines = log
        .lines()
        .filter(|line| line.contains("the shared log is unreachable"))
        .count();
    assert!(
        (1..=6).contains(&lines),
        "{lines} lines about the outage:\n{log}"
    );
}

/// A change that needs a bigger block table gets it built before the change, on the copy of
/// the index no query reads: a single server's writer and a replica's applier both go through
/// `kv_state::cell` (`Changing::make_room`), which counts every rebuild; the other copy takes
/// the same table when it catches up, and builds none.
#[tokio::test]
async fn the_writer_builds_a_bigger_table_before_the_change_that_needs_it() {
    rebuilds_are_counted(&[]).await;
    if let Some(redis) = kv_testkit::redis::RedisServer::start(false) {
        rebuilds_are_counted(&[("KV_INDEXER_EVENT_LOG", &redis.url())]).await;
    }
}

async fn rebuilds_are_counted(variables: &[(&str, &str)]) {
    let Started {
        process: _server,
        mut client,
        admin: admin_addr,
        ..
    } = start_server(variables, None).await;
    let rebuilds = || {
        metric(
            &scrape(admin_addr).unwrap(),
            "kv_indexer_table_rebuilds_total",
        )
    };
    assert_eq!(rebuilds(), Some(0.0), "{variables:?}");
    // The first REPORT needs a table, the second one four times as big: one rebuild each.
    for (hashes, expected) in [(0..1000, 1.0), (1000..5000, 2.0)] {
        let report = kv_testkit::indexer::report_request("w", hashes.collect());
        client.apply_external_kv_batch(report).await.unwrap();
        assert_eq!(rebuilds(), Some(expected), "{variables:?}");
    }
}

/// A child process killed when dropped, a failed assertion's unwinding included.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of an unlabelled series in a `/metrics` text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The server's `/metrics` once `done` holds for it, within 30 s.
fn wait_for(admin: std::net::SocketAddr, what: &str, done: &dyn Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(admin);
        if let Some(text) = text.as_ref().filter(|text| done(text)) {
            return text.clone();
        }
        assert!(Instant::now() < deadline, "{what} within 30 s: {text:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The server binary with these variables (and `RUST_LOG=info`), none inherited from the
/// caller's `KV_INDEXER_*`.
fn server(variables: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kv-indexer-server"));
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("KV_INDEXER_")) {
        command.env_remove(name);
    }
    command
        .env("RUST_LOG", "info")
        .envs(variables.iter().copied());
    command
}

/// `GET /metrics` over plain HTTP/1.1, or `None` while nothing answers.
fn scrape(addr: std::net::SocketAddr) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

#[test]
fn the_simulated_worker_exits_non_zero_naming_a_bad_setting() {
    let output = Command::new(env!("CARGO_BIN_EXE_kv-indexer-sim"))
        .env("KV_INDEXER_SIM_PAGE_SIZE", "0")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--page-size"), "{stderr}");
}

/// The value of `key=` in the simulated worker's endpoints line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

#[test]
fn the_simulated_worker_prints_its_endpoints_serves_and_stops_on_sigterm() {
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

type Client = kv_indexer_proto::v1::kv_indexer_client::KvIndexerClient<tonic::transport::Channel>;

/// A server binary on fresh ports with `variables`, its gRPC client and admin address.
struct Started {
    process: KilledOnDrop,
    client: Client,
    grpc: std::net::SocketAddr,
    admin: std::net::SocketAddr,
}

async fn start_server(variables: &[(&str, &str)], preload: Option<&std::path::Path>) -> Started {
    let (grpc, admin) = (Port::reserve(), Port::reserve());
    let (grpc_addr, admin_addr) = (grpc.addr(), admin.addr());
    drop((grpc, admin));
    let mut command = server(&[
        ("KV_INDEXER_LISTEN_ADDR", &grpc_addr.to_string()),
        ("KV_INDEXER_METRICS_ADDR", &admin_addr.to_string()),
        ("KV_INDEXER_SNAPSHOT_INTERVAL_S", "0"),
    ]);
    // KV_TEST_SERVER_LOG=1 shows the server's log (else it is kept for the test to read).
    let shown = std::env::var_os("KV_TEST_SERVER_LOG").is_some();
    command.envs(variables.iter().copied()).stderr(if shown {
        Stdio::inherit()
    } else {
        Stdio::piped()
    });
    if let Some(library) = preload {
        command.env("LD_PRELOAD", library);
    }
    let process = KilledOnDrop(command.spawn().unwrap());
    wait_for(admin_addr, "SERVING", &|text| {
        metric(text, "kv_indexer_serving") == Some(1.0)
    });
    let client = Client::connect(format!("http://{grpc_addr}"))
        .await
        .unwrap();
    Started {
        process,
        client,
        grpc: grpc_addr,
        admin: admin_addr,
    }
}

/// Worker `i`'s REPORT: 64 hashes of its own, as its bridge's first batch (so that a retry
/// after a refusal is taken for a duplicate if the refusal left the batch counted).
fn own_report(i: i64) -> kv_indexer_proto::v1::ApplyExternalKvBatchRequest {
    let mut request =
        kv_testkit::indexer::report_request(&format!("w{i}"), (i * 1000..i * 1000 + 64).collect());
    request.bridge_incarnation = Some(1);
    request.bridge_batch = Some(1);
    request
}

/// Whether the server holds worker `i`'s whole REPORT.
async fn holds(client: &mut Client, i: i64) -> bool {
    let query = kv_testkit::indexer::prefix_request((i * 1000..i * 1000 + 64).collect());
    let answer = client
        .match_external_kv_prefix(query)
        .await
        .unwrap()
        .into_inner();
    let worker = format!("w{i}");
    answer
        .matches
        .iter()
        .any(|m| m.worker_id == worker && m.matched_prefix_blocks == 64)
}

/// A tmpfs of `bytes` mounted at a new directory (unmounted when dropped); none, with a
/// message, where this process may not mount one.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(bytes: u64) -> Option<SmallDisk> {
        let dir = kv_testkit::temp_dir("kv-binaries", "small-disk");
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .stderr(Stdio::piped())
            .output();
        match mounted {
            Ok(output) if output.status.success() => Some(SmallDisk(dir)),
            other => {
                eprintln!(
                    "SKIPPED: cannot mount a small tmpfs here (needs CAP_SYS_ADMIN): {other:?}"
                );
                None
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A state directory whose disk fills: applies are refused UNAVAILABLE naming the disk,
/// queries answered, health NOT_SERVING and the gauge at 1; once room is made the next apply
/// succeeds without a restart; and after kill -9 every acknowledged apply is recovered.
#[tokio::test]
async fn a_full_disk_refuses_applies_answers_queries_and_resumes_once_there_is_room() {
    let Some(disk) = SmallDisk::mount(1 << 20) else {
        return;
    };
    let state = disk.0.join("state");
    let state_dir = state.to_str().unwrap().to_owned();
    let variables = [("KV_INDEXER_STATE_DIR", state_dir.as_str())];
    let mut server = start_server(&variables, None).await;
    // Most of the disk taken by something else.
    let filler = disk.0.join("filler");
    let room = 64 << 10;
    let free = nix_free_bytes(&disk.0);
    std::fs::write(&filler, vec![1u8; free.saturating_sub(room) as usize]).unwrap();
    let mut acknowledged = Vec::new();
    let refusal = loop {
        let i = acknowledged.len() as i64;
        match server.client.apply_external_kv_batch(own_report(i)).await {
            Ok(_) => acknowledged.push(i),
            Err(status) => break status,
        }
        assert!(i < 10_000, "64 KB never filled");
    };
    assert_eq!(refusal.code(), tonic::Code::Unavailable, "{refusal:?}");
    assert!(
        refusal.message().contains("disk") && refusal.message().contains("full"),
        "{refusal:?}"
    );
    let refused = acknowledged.len() as i64;
    assert!(refused > 0, "the disk filled before any apply");
    wait_for(server.admin, "NOT_SERVING with the gauge at 1", &|text| {
        metric(text, "kv_indexer_serving") == Some(0.0)
            && metric(text, "kv_indexer_state_unwritable") == Some(1.0)
    });
    // Queries are answered meanwhile.
    assert!(holds(&mut server.client, 0).await);
    assert!(!holds(&mut server.client, refused).await);
    // Room again: the next apply goes through, within 5 s, without a restart.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while server
        .client
        .apply_external_kv_batch(own_report(refused))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "applies still refused 5 s after room was made"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    acknowledged.push(refused);
    assert!(
        holds(&mut server.client, refused).await,
        "the retried batch was not applied"
    );
    wait_for(server.admin, "SERVING with the gauge at 0", &|text| {
        metric(text, "kv_indexer_serving") == Some(1.0)
            && metric(text, "kv_indexer_state_unwritable") == Some(0.0)
    });
    // A crash (kill -9) and a restart: every acknowledged apply is back.
    drop(server);
    let mut again = start_server(&variables, None).await;
    for &i in &acknowledged {
        assert!(
            holds(&mut again.client, i).await,
            "acknowledged apply {i} lost"
        );
    }
}

/// The bytes free to an unprivileged writer on the filesystem of `path` (`df`'s).
fn nix_free_bytes(path: &std::path::Path) -> u64 {
    let output = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8(output.stdout).unwrap();
    text.lines().nth(1).unwrap().trim().parse().unwrap()
}

/// A shared library, loaded with `LD_PRELOAD`, whose `fdatasync` fails with EIO while the file
/// named by `KV_TEST_FAIL_SYNC` exists: the failure a filesystem gives only on a bad disk.
fn failing_sync_library(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let source = dir.join("failsync.c");
    std::fs::write(
        &source,
        r#"#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>
int fdatasync(int fd) {
    const char *trigger = getenv("KV_TEST_FAIL_SYNC");
    if (trigger && access(trigger, F_OK) == 0) { errno = EIO; return -1; }
    int (*real)(int) = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    return real(fd);
}
"#,
    )
    .unwrap();
    let library = dir.join("libfailsync.so");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .arg("-ldl")
        .status();
    match built {
        Ok(status) if status.success() => Some(library),
        other => {
            assert!(
                std::env::var_os("CI").is_none(),
                "no C compiler under CI: {other:?}"
            );
            eprintln!("SKIPPED: no C compiler to build the failing fdatasync: {other:?}");
            None
        }
    }
}

/// An fdatasync of the log that fails (injected: EIO) stops the server with a non-zero exit
/// and a message, with either sync policy, rather than retrying it or serving on; a restart
/// recovers every acknowledged apply.
#[tokio::test]
async fn a_failed_fdatasync_stops_the_server_and_a_restart_recovers() {
    let dir = kv_testkit::temp_dir("kv-binaries", "failed-sync");
    std::fs::create_dir_all(&dir).unwrap();
    let Some(library) = failing_sync_library(&dir) else {
        return;
    };
    for policy in ["always", "batch"] {
        let state = dir.join(format!("state-{policy}"));
        let trigger = dir.join(format!("fail-{policy}"));
        let variables = [
            ("KV_INDEXER_STATE_DIR", state.to_str().unwrap()),
            ("KV_INDEXER_LOG_SYNC", policy),
            ("KV_TEST_FAIL_SYNC", trigger.to_str().unwrap()),
        ];
        let mut server = start_server(&variables, Some(&library)).await;
        let mut acknowledged = Vec::new();
        for i in 0..3 {
            server
                .client
                .apply_external_kv_batch(own_report(i))
                .await
                .unwrap();
            acknowledged.push(i);
        }
        std::fs::write(&trigger, b"").unwrap();
        // `always` refuses the apply whose sync failed; `batch` acknowledged it at the write.
        if server
            .client
            .apply_external_kv_batch(own_report(3))
            .await
            .is_ok()
        {
            acknowledged.push(3);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = server.process.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{policy}: still running 10 s after a failed fdatasync"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(75), "{policy}: {status:?}");
        let mut stderr = String::new();
        server
            .process
            .0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(
            stderr.contains("exiting so that a restart recovers from the log"),
            "{policy}: {stderr}"
        );
        std::fs::remove_file(&trigger).unwrap();
        let mut again = start_server(&variables[..2], None).await;
        for &i in &acknowledged {
            assert!(
                holds(&mut again.client, i).await,
                "{policy}: acknowledged apply {i} lost"
            );
        }
    }
}

/// The `grpc-status` of a unary call to `path` whose message is `body` (ASCII: the frame goes
/// as a `String` body), over a bare HTTP/2 connection (tonic's client would refuse to send what
/// is not its message).
async fn raw_call(addr: std::net::SocketAddr, path: &str, body: &[u8]) -> Option<String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    let request = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(String::from_utf8(frame).expect("an ASCII frame"))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.headers().get("grpc-status");
    status.map(|v| v.to_str().unwrap().to_owned())
}

/// A call whose message does not decode (another version of the protocol) answers
/// INVALID_ARGUMENT, not INTERNAL, and is counted under its method; an unknown method is
/// counted as `unknown`.
#[tokio::test]
async fn undecodable_calls_are_invalid_arguments_and_counted() {
    let server = start_server(&[], None).await;
    let (grpc_addr, admin_addr) = (server.grpc, server.admin);
    // Field 2, length-delimited, 127 bytes long, and nothing after: a truncated message.
    let garbage = [0x12, 0x7f];
    for method in [
        "MatchExternalKv",
        "ApplyExternalKvBatch",
        "GetExternalKvHitCounts",
    ] {
        let path = format!("/kv_indexer.v1.KVIndexer/{method}");
        let status = raw_call(grpc_addr, &path, &garbage).await;
        assert_eq!(status.as_deref(), Some("3"), "{method}");
    }
    let unknown = raw_call(grpc_addr, "/kv_indexer.v2.KVIndexer/Nope", &[]).await;
    assert_eq!(unknown.as_deref(), Some("12"));
    let text = scrape(admin_addr).unwrap();
    for (rpc, code) in [
        ("MatchExternalKv", "InvalidArgument"),
        ("ApplyExternalKvBatch", "InvalidArgument"),
        ("unknown", "Unimplemented"),
    ] {
        let series = format!("kv_indexer_requests_total{{rpc=\"{rpc}\",code=\"{code}\"}} 1");
        assert!(text.contains(&series), "no {series} in\n{text}");
    }
}

/// The router's stderr within `wait`, and whether `needle` appeared in it: the router is
/// started with `args`, and killed once the line shows or the wait is over.
fn router_says(args: &[&str], needle: &str, wait: Duration) -> (bool, String) {
    let mut child = KilledOnDrop(
        Command::new(env!("CARGO_BIN_EXE_kv-indexer-router"))
            .args(["--listen-addr", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = child.0.stderr.take().unwrap();
    let (lines, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + wait;
    let mut text = String::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = seen.recv_timeout(left) else {
            break;
        };
        text.push_str(&line);
        text.push('\n');
        if line.contains(needle) {
            return (true, text);
        }
    }
    (false, text)
}

/// A router started without a tokenizer warns that real workers' prompts will never match;
/// with one, it does not.
#[test]
fn a_router_without_a_tokenizer_warns_at_start() {
    let workers = ["--worker-urls", "http://127.0.0.1:9"];
    let needle = "no --tokenizer-path";
    let (warned, text) = router_says(&workers, needle, Duration::from_secs(20));
    assert!(warned, "no warning in:\n{text}");
    assert!(text.contains("WARN"), "{text}");
    let tokenizer = kv_testkit::tokenizer::BosTokenizer::write("router-warning", 100);
    let path = tokenizer.path.to_str().unwrap();
    let with = [&workers[..], &["--tokenizer-path", path]].concat();
    let (warned, text) = router_says(&with, needle, Duration::from_secs(3));
    assert!(!warned, "warned with a tokenizer:\n{text}");
}

/// The bridge's binary stops at start naming the variable it cannot use.
#[test]
fn the_binary_exits_non_zero_naming_a_bad_variable() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-bridge"))
        .env("KV_INDEXER_WORKER_ID", "w")
        .env("KV_INDEXER_CACHE_COMPONENTS", "full,swa")
        .env_remove("KV_INDEXER_SWA_WINDOW_TOKENS")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("KV_INDEXER_SWA_WINDOW_TOKENS"), "{stderr}");
}
