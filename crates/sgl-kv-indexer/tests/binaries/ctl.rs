//! `kv-indexer-ctl`, the binary, against a server on loopback: hashing, each query command
//! in table and JSON form, and the exit status when the Indexer cannot answer.

use std::process::Output;

use kv_indexer_client::hashing::{HashConfig, block_hashes};
use kv_indexer_client::simple_tokenize;
use kv_server::{Config, boot};
use kv_testkit::booted::Listening;
use kv_testkit::indexer::{DRAM, HBM, REPORT, action, apply_request};
use kv_testkit::{Port, TestIndexer};
use serde_json::Value;

const TEXT: &str = "you are a helpful assistant . answer briefly and cite sources";

/// Runs the binary off the runtime's thread, so the in-process server keeps serving.
async fn ctl(args: &[String]) -> Output {
    let args = args.to_vec();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-ctl"))
            .args(&args)
            .env_remove("KV_INDEXER_ENDPOINT")
            .env_remove("KV_INDEXER_CTL_TIMEOUT_MS")
            .env_remove("KV_INDEXER_BLOCK_SIZE")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(ToString::to_string).collect()
}

/// Runs a command that must succeed and parses its JSON.
async fn ctl_json(list: Vec<String>) -> Value {
    let output = ctl(&list).await;
    assert!(
        output.status.success(),
        "{list:?}: {:?} {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn text_hashes(block_size: usize) -> Vec<i64> {
    block_hashes(
        &simple_tokenize(TEXT),
        HashConfig {
            block_size,
            bigram: false,
        },
        None,
    )
}

#[tokio::test]
async fn hashes_text_as_the_library_does() {
    let json = ctl_json(args(&[
        "--json",
        "hash",
        "--text",
        TEXT,
        "--block-size",
        "4",
    ]))
    .await;
    let hashes: Vec<i64> = serde_json::from_value(json["hashes"].clone()).unwrap();
    assert_eq!(hashes, text_hashes(4));
    assert_eq!(json["token_ids"].as_array().unwrap().len(), 11);
}

#[tokio::test]
async fn asks_a_running_server_for_prefixes_placements_and_hits() {
    let server = TestIndexer::start().await;
    let hashes = text_hashes(4);
    assert_eq!(hashes.len(), 3);
    server.report("a", "http://a:30000", HBM, &hashes).await;
    let endpoint = server.url();
    let with = |list: &[&str]| {
        let mut full = args(&["--endpoint", &endpoint]);
        full.extend(args(list));
        full
    };

    let prefix = ctl_json(with(&[
        "--json",
        "prefix",
        "--text",
        TEXT,
        "--block-size",
        "4",
    ]))
    .await;
    assert_eq!(prefix["outcome"], "matched");
    assert_eq!(prefix["best_prefix_blocks"], 3);
    assert_eq!(prefix["query_blocks"], 3);
    assert_eq!(prefix["matches"][0]["worker_id"], "a");
    assert_eq!(prefix["matches"][0]["worker_address"], "http://a:30000");

    // The same question in blocks, with one more block nobody holds, as a table.
    let mut blocks: Vec<String> = hashes.iter().map(ToString::to_string).collect();
    blocks.push("-7".into());
    let mut list = vec!["prefix".to_string()];
    list.extend(blocks.iter().cloned());
    let output = ctl(&with(&list.iter().map(String::as_str).collect::<Vec<_>>())).await;
    assert!(output.status.success());
    let table = String::from_utf8(output.stdout).unwrap();
    assert!(table.contains("best prefix 3 of 4 blocks"), "{table}");
    assert!(table.contains(" 75.0%  http://a:30000"), "{table}");

    let first_two = [blocks[0].as_str(), blocks[1].as_str()];
    let mut list = vec!["--json", "match", "--count-as-hit"];
    list.extend(first_two);
    let matched = ctl_json(with(&list)).await;
    assert_eq!(matched["matches"][0]["worker_id"], "a");
    assert_eq!(matched["matches"][0]["tiers"][0]["tier"], "HBM");
    assert_eq!(
        matched["matches"][0]["tiers"][0]["hashes"],
        serde_json::json!([hashes[0], hashes[1]])
    );

    let joined = format!("{},{},{}", blocks[0], blocks[1], blocks[2]);
    let hits = ctl_json(with(&["--json", "hits", &joined])).await;
    assert_eq!(
        hits["entries"],
        serde_json::json!([
            { "hash": hashes[0], "hit_count_total": 1 },
            { "hash": hashes[1], "hit_count_total": 1 },
        ])
    );
}

#[tokio::test]
async fn exits_with_1_when_the_indexer_cannot_answer() {
    // A reserved port that nothing listens on: every connection is refused.
    let port = Port::reserve();
    let dead = port.url();
    let output = ctl(&args(&["--endpoint", &dead, "--json", "prefix", "1", "2"])).await;
    assert_eq!(output.status.code(), Some(1));
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["outcome"], "unreachable");

    let output = ctl(&args(&["--endpoint", &dead, "hits", "1"])).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("Unavailable"), "{stderr}");
    assert!(
        stderr.contains(&format!("(asked {dead})")),
        "names what it asked: {stderr}"
    );
}

#[tokio::test]
async fn health_and_prefix_tell_a_recovering_server_from_an_unreachable_one() {
    // A server that listens but has not loaded its state yet (boot not run).
    let config = Config::default();
    let server = Listening::start(&config).await;
    let endpoint = format!("http://{}", server.addr);

    let output = ctl(&args(&["--endpoint", &endpoint, "health"])).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("NOT_SERVING"), "{stderr}");
    let output = ctl(&args(&["--endpoint", &endpoint, "prefix", "1", "2"])).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.starts_with("error: unreachable: Unavailable: ") && stderr.contains("recover"),
        "the server's reason, not only its class: {stderr}"
    );

    boot::boot(&server.shared, &config).await.unwrap();
    let json = ctl_json(args(&["--endpoint", &endpoint, "--json", "health"])).await;
    assert_eq!(json["serving"], true);
    assert_eq!(json["replicas"][0]["status"], "SERVING");

    // A list with one replica down is not healthy.
    let dead = Port::reserve().url();
    let both = format!("{endpoint},{dead}");
    let output = ctl(&args(&["--endpoint", &both, "health"])).await;
    assert_eq!(output.status.code(), Some(1));
    server.stop.cancel();
}

/// `state`, `workers` and `drop`: the drop takes the worker out of every answer and needs the
/// write token (that it goes through the log is `kv-state`'s fleet and durable tests).
#[tokio::test]
async fn lists_the_workers_and_drops_one_with_the_write_token() {
    let argv = ["kv-indexer-server", "--write-token", "w-secret"];
    let config = Config::from_args(&<kv_server::Args as clap::Parser>::parse_from(argv)).unwrap();
    let server = TestIndexer::with_config(config).await;
    let mut client = server.client();
    for (worker, tier, hashes) in [
        ("a", HBM, vec![1, 2, 3]),
        ("a", DRAM, vec![4]),
        ("b", HBM, vec![1, 2]),
    ] {
        let mut apply = apply_request(worker, vec![action(REPORT, tier, &hashes)]);
        apply.seq = 1;
        let mut request = tonic::Request::new(apply);
        request
            .metadata_mut()
            .insert("authorization", "Bearer w-secret".parse().unwrap());
        client.apply_external_kv_batch(request).await.unwrap();
    }
    let endpoint = server.url();
    let with = |list: &[&str]| {
        let mut full = args(&["--endpoint", &endpoint]);
        full.extend(args(list));
        full
    };

    let state = ctl_json(with(&["--json", "state", "--digest"])).await;
    let replica = &state["replicas"][0];
    assert_eq!(replica["ready"], true);
    assert_eq!(replica["workers"], 2);
    assert_eq!(replica["placements"], 6);
    assert_eq!(replica["digest"].as_str().unwrap().len(), 64, "{state}");

    let workers = ctl_json(with(&["--json", "workers"])).await;
    let a = &workers["workers"][0];
    assert_eq!(a["worker_id"], "a");
    assert_eq!(a["worker_address"], "http://a:30000");
    assert_eq!(a["placements"]["hbm"], 3);
    assert_eq!(a["placements"]["dram"], 1);
    assert_eq!(a["expired"], false);
    assert!(a["last_apply_age_s"].as_f64().unwrap() < 60.0, "{a}");
    assert_eq!(workers["workers"][1]["placements"]["hbm"], 2);
    let table = String::from_utf8(ctl(&with(&["workers"])).await.stdout).unwrap();
    assert!(table.lines().nth(1).unwrap().starts_with("a "), "{table}");

    // Without the write token, the drop is refused and changes nothing.
    let output = ctl(&with(&["drop", "a"])).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("DropWorker needs the Indexer's write token"),
        "{stderr}"
    );
    let unknown = ctl(&with(&["--indexer-token", "w-secret", "drop", "c"])).await;
    assert_eq!(unknown.status.code(), Some(1));
    let stderr = String::from_utf8(unknown.stderr).unwrap();
    assert!(
        stderr.contains("NotFound") && stderr.contains("\"c\""),
        "{stderr}"
    );

    let dropped = ctl_json(with(&[
        "--indexer-token",
        "w-secret",
        "--json",
        "drop",
        "a",
    ]))
    .await;
    assert_eq!(dropped["placements_dropped"], 4);
    let workers = ctl_json(with(&["--json", "workers"])).await;
    assert_eq!(workers["workers"][0]["expired"], true);
    assert_eq!(workers["workers"][0]["placements"]["hbm"], 0);
    let prefix = ctl_json(with(&["--json", "prefix", "1", "2", "3"])).await;
    assert_eq!(prefix["matches"].as_array().unwrap().len(), 1, "{prefix}");
    assert_eq!(prefix["matches"][0]["worker_id"], "b");
}

#[tokio::test]
async fn exits_with_2_naming_a_bad_endpoint() {
    let output = ctl(&args(&["--endpoint", "localhost:50051", "prefix", "1"])).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("--endpoint (KV_INDEXER_ENDPOINT)") && stderr.contains("localhost:50051"),
        "{stderr}"
    );
}

/// The recipe SECURITY.md gives (`scripts/make_test_certs.sh`) makes certificates the server
/// takes for TLS and mutual TLS: `kv-indexer-ctl health` over https with the client's
/// certificate is answered SERVING, and without it the handshake is refused.
#[tokio::test]
async fn the_certificate_recipe_makes_certificates_the_server_accepts() {
    if std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "openssl is missing under CI"
        );
        eprintln!("skipped: no openssl");
        return;
    }
    let dir = kv_testkit::temp_dir("kv-ctl", "certs");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/make_test_certs.sh"
    );
    let made = std::process::Command::new(script)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let file = |name: &str| dir.join(name).display().to_string();
    let port = Port::reserve();
    let addr = port.addr();
    drop(port);
    let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-server"))
        .env("KV_INDEXER_LISTEN_ADDR", addr.to_string())
        .env("KV_INDEXER_TLS_CERT", file("server.pem"))
        .env("KV_INDEXER_TLS_KEY", file("server.key"))
        .env("KV_INDEXER_TLS_CLIENT_CA", file("ca.pem"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let endpoint = format!("https://localhost:{}", addr.port());
    let ca = file("ca.pem");
    let with_client = args(&[
        "--endpoint",
        &endpoint,
        "--indexer-ca",
        &ca,
        "--indexer-client-cert",
        &file("client.pem"),
        "--indexer-client-key",
        &file("client.key"),
        "health",
    ]);
    let mut answered = None;
    for _ in 0..100 {
        let output = ctl(&with_client).await;
        if output.status.success() {
            answered = Some(output);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let output = answered.expect("the server took the recipe's certificates within 10 s");
    assert!(String::from_utf8_lossy(&output.stdout).contains("SERVING"));
    let without = ctl(&args(&[
        "--endpoint",
        &endpoint,
        "--indexer-ca",
        &ca,
        "health",
    ]))
    .await;
    assert_eq!(without.status.code(), Some(1), "no client certificate");
    server.kill().await.unwrap();
}
