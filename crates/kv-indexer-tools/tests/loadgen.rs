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
