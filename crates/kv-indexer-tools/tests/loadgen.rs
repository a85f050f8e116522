//! `kv-indexer-loadgen`, the binary, against a server on loopback: its report counts the
//! answers the server gave (the counted decoding of prefix answers, checked end to end).

use kv_testkit::TestIndexer;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_what_the_server_answered() {
    let server = TestIndexer::start().await;
    let report = kv_testkit::temp_dir("loadgen", "report");
    let args: Vec<String> = [
        "--endpoint",
        &server.url(),
        "--workers",
        "4",
        "--prompts",
        "4",
        "--prompt-blocks",
        "64",
        "--qps",
        "0",
        "--concurrency",
        "2",
        "--duration-secs",
        "1",
        "--json-out",
        report.to_str().unwrap(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    // Off the runtime's threads, so the in-process server keeps serving.
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-loadgen"))
            .args(&args)
            .env_remove("KV_INDEXER_ENDPOINT")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{:?} {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let line = std::fs::read_to_string(&report).unwrap();
    let run: Value = serde_json::from_str(line.trim()).unwrap();
    assert!(run["answered"].as_u64().unwrap() > 0, "{run}");
    assert_eq!(run["failed_per_s"], 0.0, "{run}");
    // Each prompt is held whole by one worker and cut short by up to two more, so every answer
    // matches the whole prompt and names one to three workers.
    assert_eq!(run["mean_best_prefix_blocks"], 64.0, "{run}");
    let matches = run["mean_matches"].as_f64().unwrap();
    assert!((1.0..=3.0).contains(&matches), "{run}");
    let _ = std::fs::remove_file(&report);
}

/// `--write-query` writes prompt 0's prefix query as one gRPC message (what h2load sends from a
/// file): after a preload with the same workload, the server answers it with the whole prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_written_query_is_a_prompt_the_preload_reported() {
    use kv_indexer_proto::v1 as pb;
    use prost::Message;

    let server = TestIndexer::start().await;
    let body = kv_testkit::temp_dir("loadgen", "query");
    let workload = ["--workers", "4", "--prompts", "4", "--prompt-blocks", "64"];
    let run = |extra: Vec<String>| {
        let mut args: Vec<String> = workload.iter().map(ToString::to_string).collect();
        args.extend(extra);
        tokio::task::spawn_blocking(move || {
            let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-loadgen"))
                .args(&args)
                .env_remove("KV_INDEXER_ENDPOINT")
                .output()
                .unwrap();
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
        })
    };
    let preload = ["--endpoint", &server.url(), "--duration-secs", "0"];
    run(preload.iter().map(ToString::to_string).collect())
        .await
        .unwrap();
    run(vec!["--write-query".into(), body.to_str().unwrap().into()])
        .await
        .unwrap();

    let frame = std::fs::read(&body).unwrap();
    assert_eq!(frame[0], 0, "not compressed");
    let len = u32::from_be_bytes(frame[1..5].try_into().unwrap()) as usize;
    assert_eq!(frame.len(), 5 + len, "one whole message");
    let query = pb::MatchExternalKvPrefixRequest::decode(&frame[5..]).unwrap();
    assert_eq!(query.hashes.len(), 64);
    let mut client = pb::kv_indexer_client::KvIndexerClient::new(server.channel());
    let answer = client
        .match_external_kv_prefix(query)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.best_prefix_blocks, 64, "{answer:?}");
    let _ = std::fs::remove_file(&body);
}
