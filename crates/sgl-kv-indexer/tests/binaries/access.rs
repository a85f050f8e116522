//! Access control end to end on loopback: TLS, mutual TLS and the read and write tokens, with
//! certificates generated here (a CA, the server's and a client's, and a rogue CA's client),
//! and the bridge binary exiting on a wrong token.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use kv_indexer_client::client::{error_chain, transport_is_unavailable};
use kv_indexer_client::security::Grpc;
use kv_indexer_client::{ClientConfig, ClientSecurity, Endpoint, IndexerClient, PrefixOutcome};
use kv_indexer_proto::v1 as pb;
use kv_server::{Args, Config, Shared, server};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// PEM files in a directory of their own: `ca.pem`, `server.{pem,key}`, `client.{pem,key}`,
/// and `rogue.{pem,key}` (a client certificate from another CA).
fn pki(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("access-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = |cn: &str| {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, cn);
        CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
    };
    let leaf = |issuer: &CertifiedIssuer<'_, KeyPair>,
                names: &[&str],
                usage: ExtendedKeyUsagePurpose,
                file: &str| {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        std::fs::write(dir.join(format!("{file}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
    };
    let trusted = ca("test CA");
    std::fs::write(dir.join("ca.pem"), trusted.pem()).unwrap();
    leaf(
        &trusted,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
        "server",
    );
    leaf(
        &trusted,
        &["bridge-0"],
        ExtendedKeyUsagePurpose::ClientAuth,
        "client",
    );
    let rogue = ca("rogue CA");
    leaf(
        &rogue,
        &["bridge-0"],
        ExtendedKeyUsagePurpose::ClientAuth,
        "rogue",
    );
    dir
}

/// A server on `127.0.0.1:0` started from server flags, stopped when dropped.
struct Running {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start(flags: &[String]) -> Running {
    let mut argv = vec!["kv-indexer-server".to_string()];
    argv.extend_from_slice(flags);
    let args = <Args as clap::Parser>::try_parse_from(argv).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shared = server::shared(&Config::from_args(&args).unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(server::run(
        listener,
        shared.clone(),
        stop.clone().cancelled_owned(),
    ));
    Running { addr, shared, stop }
}

fn tls_flags(dir: &Path, mutual: bool) -> Vec<String> {
    let mut flags = vec![
        "--tls-cert".to_string(),
        dir.join("server.pem").display().to_string(),
        "--tls-key".into(),
        dir.join("server.key").display().to_string(),
    ];
    if mutual {
        flags.extend([
            "--tls-client-ca".to_string(),
            dir.join("ca.pem").display().to_string(),
        ]);
    }
    flags
}

/// A server that requires a client certificate from the CA of `pki(name)` and the write token
/// `w-secret`, and that PKI's directory.
async fn start_mutual_tls_with_write_token(name: &str) -> (PathBuf, Running) {
    let dir = pki(name);
    let mut flags = tls_flags(&dir, true);
    flags.extend(["--write-token".to_string(), "w-secret".into()]);
    (dir, start(&flags).await)
}

/// The real bridge binary for `worker-0`, applying to `endpoint` and following a publisher
/// that never sends (so its first apply is its start-up clear), which it returns: it must live
/// as long as the bridge runs.
async fn bridge_command(endpoint: String) -> (zeromq::PubSocket, tokio::process::Command) {
    let mut publisher = <zeromq::PubSocket as zeromq::Socket>::new();
    let bound = zeromq::Socket::bind(&mut publisher, "tcp://127.0.0.1:0")
        .await
        .unwrap();
    let mut bridge = tokio::process::Command::new(env!("CARGO_BIN_EXE_kv-indexer-bridge"));
    bridge
        .env_clear()
        .env("KV_INDEXER_WORKER_ID", "worker-0")
        .env("KV_INDEXER_ENDPOINT", endpoint)
        .env("SGLANG_KV_EVENT_ENDPOINT", bound.to_string())
        .env("KV_INDEXER_HEARTBEAT_MS", "100")
        .stdout(Stdio::null())
        .kill_on_drop(true);
    (publisher, bridge)
}

fn trusting(dir: &Path) -> ClientSecurity {
    ClientSecurity {
        ca_file: Some(dir.join("ca.pem")),
        ..ClientSecurity::default()
    }
}

fn with_identity(security: ClientSecurity, dir: &Path, name: &str) -> ClientSecurity {
    ClientSecurity {
        cert_file: Some(dir.join(format!("{name}.pem"))),
        key_file: Some(dir.join(format!("{name}.key"))),
        ..security
    }
}

fn with_token(security: ClientSecurity, token: &str) -> ClientSecurity {
    ClientSecurity {
        token: Some(token.into()),
        ..security
    }
}

/// The raw gRPC client, as the bridge makes it.
fn grpc(url: &str, security: &ClientSecurity) -> Grpc {
    let credentials = security.load().unwrap();
    let channel = credentials
        .endpoint(url)
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    credentials.client(channel)
}

/// The router's client, as the router and the CLI make it.
fn router_client(url: &str, security: ClientSecurity) -> IndexerClient {
    let mut config = ClientConfig::new(vec![Endpoint::parse(url).unwrap()]);
    config.query_timeout = Duration::from_secs(5);
    config.security = security;
    IndexerClient::new(config).unwrap()
}

const HASHES: [i64; 3] = [11, 22, 33];

fn report() -> pb::ApplyExternalKvBatchRequest {
    pb::ApplyExternalKvBatchRequest {
        worker_id: "worker-0".into(),
        seq: 1,
        actions: vec![pb::ExternalKvAction {
            r#type: pb::ExternalKvActionType::ActionReport as i32,
            tier: pb::TierType::TierHbm as i32,
            hashes: HASHES.to_vec(),
            ..Default::default()
        }],
        worker_address: "http://127.0.0.1:30000".into(),
        cache_spec: None,
        bridge_incarnation: None,
        bridge_batch: None,
    }
}

fn placements(server: &Running) -> usize {
    server.shared.index_stats().placements
}

/// One apply; a connection that fails under the call is UNAVAILABLE, as the bridge sees it.
async fn apply(url: &str, security: &ClientSecurity) -> Result<(), tonic::Status> {
    grpc(url, security)
        .apply_external_kv_batch(report())
        .await
        .map(drop)
        .map_err(transport_is_unavailable)
}

fn matched_blocks(outcome: &PrefixOutcome) -> Option<u32> {
    match outcome {
        PrefixOutcome::Matched {
            best_prefix_blocks, ..
        } => Some(*best_prefix_blocks),
        _ => None,
    }
}

#[tokio::test]
async fn tls_serves_clients_that_trust_its_ca_and_only_them() {
    let dir = pki("tls");
    let server = start(&tls_flags(&dir, false)).await;
    let url = format!("https://localhost:{}", server.addr.port());

    apply(&url, &trusting(&dir)).await.unwrap();
    assert_eq!(placements(&server), 3);
    let outcome = router_client(&url, trusting(&dir))
        .longest_prefix(&HASHES)
        .await;
    assert_eq!(matched_blocks(&outcome), Some(3), "{outcome:?}");

    // The system roots do not know the test CA: the handshake fails, nothing is applied.
    let error = apply(&url, &ClientSecurity::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unavailable, "{error:?}");
    // A plain HTTP/2 client gets no answer from a TLS listener.
    let plain = format!("http://127.0.0.1:{}", server.addr.port());
    let error = apply(&plain, &ClientSecurity::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unavailable, "{error:?}");
    // The certificate names localhost and 127.0.0.1, not another host.
    let renamed = ClientSecurity {
        tls_domain: Some("indexer.example".into()),
        ..trusting(&dir)
    };
    assert!(apply(&url, &renamed).await.is_err());
    assert_eq!(placements(&server), 3);
}

#[tokio::test]
async fn mutual_tls_needs_a_client_certificate_from_the_client_ca() {
    let dir = pki("mtls");
    let server = start(&tls_flags(&dir, true)).await;
    let url = format!("https://localhost:{}", server.addr.port());

    for (who, security) in [
        ("no client certificate", trusting(&dir)),
        (
            "a rogue CA's certificate",
            with_identity(trusting(&dir), &dir, "rogue"),
        ),
    ] {
        let error = apply(&url, &security).await.expect_err(who);
        assert_eq!(error.code(), Code::Unavailable, "{who}: {error:?}");
        let outcome = router_client(&url, security).longest_prefix(&HASHES).await;
        assert_eq!(outcome, PrefixOutcome::Unreachable, "{who}");
    }
    assert_eq!(placements(&server), 0);

    let client = with_identity(trusting(&dir), &dir, "client");
    apply(&url, &client).await.unwrap();
    let outcome = router_client(&url, client).longest_prefix(&HASHES).await;
    assert_eq!(matched_blocks(&outcome), Some(3), "{outcome:?}");
}

#[tokio::test]
async fn the_write_token_guards_applies() {
    let server = start(&["--write-token".into(), "w-secret".into()]).await;
    let url = format!("http://{}", server.addr);
    let open = ClientSecurity::default();

    for (who, security) in [
        ("no token", open.clone()),
        ("a wrong token", with_token(open.clone(), "w-secreT")),
    ] {
        let status = apply(&url, &security).await.expect_err(who);
        assert_eq!(status.code(), Code::Unauthenticated, "{who}");
        assert!(
            status
                .message()
                .contains("ApplyExternalKvBatch needs the Indexer's write token"),
            "{who}: {}",
            status.message()
        );
    }
    assert_eq!(placements(&server), 0, "a refused apply changes nothing");

    apply(&url, &with_token(open.clone(), "w-secret"))
        .await
        .unwrap();
    assert_eq!(placements(&server), 3);
    // Without a read token, queries stay open.
    let outcome = router_client(&url, open).longest_prefix(&HASHES).await;
    assert_eq!(matched_blocks(&outcome), Some(3), "{outcome:?}");
}

#[tokio::test]
async fn the_read_token_guards_queries_and_the_write_token_also_reads() {
    let server = start(&[
        "--write-token".into(),
        "w-secret".into(),
        "--read-token".into(),
        "r-secret".into(),
    ])
    .await;
    let url = format!("http://{}", server.addr);
    let open = ClientSecurity::default();
    apply(&url, &with_token(open.clone(), "w-secret"))
        .await
        .unwrap();

    let outcome = router_client(&url, open.clone())
        .longest_prefix(&HASHES)
        .await;
    assert!(
        matches!(&outcome, PrefixOutcome::Rejected { code: Code::Unauthenticated, message } if message.contains("read token")),
        "{outcome:?}"
    );
    let reader = router_client(&url, with_token(open.clone(), "r-secret"));
    assert_eq!(
        matched_blocks(&reader.longest_prefix(&HASHES).await),
        Some(3)
    );
    let hits = reader.hit_counts(&HASHES).await;
    assert!(hits.is_ok(), "{hits:?}");
    let writer = router_client(&url, with_token(open.clone(), "w-secret"));
    assert_eq!(
        matched_blocks(&writer.longest_prefix(&HASHES).await),
        Some(3)
    );
    // The read token does not write.
    let status = apply(&url, &with_token(open.clone(), "r-secret"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);

    // Health stays open for load balancers.
    let channel = tonic::transport::Channel::from_shared(url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test]
async fn tokens_travel_inside_tls_with_a_client_certificate() {
    let (dir, server) = start_mutual_tls_with_write_token("all").await;
    let url = format!("https://localhost:{}", server.addr.port());
    let client = with_identity(trusting(&dir), &dir, "client");

    let status = apply(&url, &client).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    apply(&url, &with_token(client, "w-secret")).await.unwrap();
    assert_eq!(placements(&server), 3);
}

#[tokio::test]
async fn bad_tls_settings_are_refused_at_start_naming_the_setting() {
    let dir = pki("settings");
    let check = |flags: Vec<String>, needle: &str| {
        let mut argv = vec!["kv-indexer-server".to_string()];
        argv.extend(flags);
        let args = <Args as clap::Parser>::try_parse_from(argv).unwrap();
        let error = error_chain(&Config::from_args(&args).unwrap_err());
        assert!(error.contains(needle), "{error:?} lacks {needle:?}");
    };
    let path = |name: &str| dir.join(name).display().to_string();
    check(
        vec!["--tls-cert".into(), path("server.pem")],
        "KV_INDEXER_TLS_KEY (--tls-key) go together",
    );
    check(
        vec!["--tls-client-ca".into(), path("ca.pem")],
        "KV_INDEXER_TLS_CLIENT_CA (--tls-client-ca) needs",
    );
    check(
        vec![
            "--tls-cert".into(),
            path("missing.pem"),
            "--tls-key".into(),
            path("server.key"),
        ],
        "reading KV_INDEXER_TLS_CERT",
    );
    check(
        vec![
            "--tls-cert".into(),
            path("server.key"),
            "--tls-key".into(),
            path("server.key"),
        ],
        "holds no PEM CERTIFICATE",
    );
    check(
        vec![
            "--tls-cert".into(),
            path("server.pem"),
            "--tls-key".into(),
            path("client.key"),
        ],
        "the key does not fit the certificate",
    );
    check(
        vec!["--write-token".into(), "has space".into()],
        "KV_INDEXER_WRITE_TOKEN",
    );
}

/// The real bridge binary against a server with a write token: a wrong token is permanent, so
/// the bridge exits non-zero at its first apply with a message naming the token.
#[tokio::test]
async fn a_bridge_with_a_wrong_token_exits_with_a_clear_message() {
    let server = start(&["--write-token".into(), "w-secret".into()]).await;
    let (_publisher, mut bridge) = bridge_command(format!("http://{}", server.addr)).await;
    let output = bridge
        .env("KV_INDEXER_TOKEN", "not-the-token")
        .stderr(Stdio::piped())
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), output)
        .await
        .expect("the bridge must exit on its own")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("the indexer refused the bridge's token")
            && stderr.contains("KV_INDEXER_TOKEN"),
        "{stderr}"
    );
    assert_eq!(placements(&server), 0);
}

/// The same binary with the right token and a client certificate reaches a TLS server that
/// requires both: its start-up clear lands and the worker is known.
#[tokio::test]
async fn a_bridge_with_its_certificate_and_token_applies_over_mutual_tls() {
    let (dir, server) = start_mutual_tls_with_write_token("bridge").await;
    let endpoint = format!("https://localhost:{}", server.addr.port());
    let (_publisher, mut bridge) = bridge_command(endpoint).await;
    let mut bridge = bridge
        .env("KV_INDEXER_TOKEN", "w-secret")
        .env("KV_INDEXER_TLS_CA", dir.join("ca.pem"))
        .env("KV_INDEXER_CLIENT_CERT", dir.join("client.pem"))
        .env("KV_INDEXER_CLIENT_KEY", dir.join("client.key"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while server.shared.index_stats().workers == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bridge's apply never landed"
        );
        assert!(bridge.try_wait().unwrap().is_none(), "the bridge exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bridge.kill().await.unwrap();
}
