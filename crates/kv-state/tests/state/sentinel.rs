//! A fleet on `redis+sentinel://`: a primary, its replica and three sentinels on loopback (all
//! real `redis-server`s, the sentinels in `--sentinel` mode). The primary is killed mid-stream;
//! the sentinels promote the replica and the fleet follows it without a restart. With
//! `MIN_REPLICAS` 1 every acknowledged apply survives the failover (nothing under-claimed);
//! without, the sequence gate leaves nothing over-claimed either way.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::common::{State, apply_retrying, numbered, replica_settings, report, revoke};
use kv_state::config::StateConfig;
use kv_state::error::ChangeError;
use kv_state::stream::StreamConfig;
use kv_testkit::redis::RedisServer;
use kv_testkit::wait;

/// Three sentinels watching `primary` as `mymaster` (quorum 2, down after 1 s); killed when
/// dropped.
struct Sentinels {
    children: Vec<Child>,
    ports: Vec<u16>,
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Sentinels {
    /// The port of the primary the first sentinel names now.
    fn primary(&self) -> Option<u16> {
        let url = format!("redis://127.0.0.1:{}/", self.ports[0]);
        let mut connection = redis::Client::open(url).ok()?.get_connection().ok()?;
        let named: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg("mymaster")
            .query(&mut connection)
            .ok()?;
        named.map(|(_, port)| port)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

fn sentinels(primary_port: u16, dir: &Path) -> Sentinels {
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for i in 0..3 {
        let port = free_port();
        let conf = dir.join(format!("sentinel-{i}.conf"));
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor mymaster 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 5000\n\
                 sentinel parallel-syncs mymaster 1\n",
                dir.display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting a sentinel");
        children.push(child);
        ports.push(port);
    }
    Sentinels { children, ports }
}

fn settings(sentinels: &Sentinels, min_replicas: u32) -> StateConfig {
    let hosts: Vec<String> = sentinels
        .ports
        .iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    let url = format!("redis+sentinel://{}/mymaster/0", hosts.join(","));
    let stream = StreamConfig::new(&url, "sgl-kv-indexer:events", None).unwrap();
    replica_settings(stream.with_min_replicas(min_replicas), None)
}

/// What the fleet claims after the failover, on the replica that took the applies and on one
/// that joins afterwards: (blocks of 1-10, revoked before the kill; blocks of 11-40, held).
type Claims = ((usize, usize), (usize, usize));

/// Runs the failover with `min_replicas`: the worker reports 1-20, revokes 1-10, the primary
/// is killed, the worker reports 21-40 (re-syncing with everything it holds if the fleet
/// answers that it lost acknowledged batches).
async fn failover(min_replicas: u32) -> Option<Claims> {
    let mut primary = RedisServer::start(false)?;
    let _replica = RedisServer::start_replica_of(&primary).unwrap();
    let dir = kv_testkit::temp_dir("kv-state-sentinel", &format!("min-{min_replicas}"));
    std::fs::create_dir_all(&dir).unwrap();
    let watch = sentinels(primary.port(), &dir);
    let state = State::open(settings(&watch, min_replicas)).await.unwrap();
    wait::until_ok("the replica serves", || async { state.check() }).await;
    let (revoked, held): (Vec<i64>, Vec<i64>) = ((1..=10).collect(), (11..=40).collect());
    let mut batch = 0;
    let mut next = || {
        batch += 1;
        batch
    };
    for hashes in [&revoked[..], &held[..10]] {
        apply_retrying(&state, numbered(report("w", hashes), next()))
            .await
            .unwrap();
    }
    apply_retrying(&state, numbered(revoke("w", &revoked), next()))
        .await
        .unwrap();

    primary.kill();
    // The sentinels promote the replica; the killed primary comes back once they have, and
    // they make it a replica of the new one (so that MIN_REPLICAS 1 can be met again).
    let old = primary.port();
    wait::until_ok("the sentinels' failover", || async {
        watch.primary().filter(|&p| p != old).ok_or(())
    })
    .await;
    primary.restart();
    for hashes in held[10..].chunks(10) {
        let answer = apply_retrying(&state, numbered(report("w", hashes), next())).await;
        if let Err(ChangeError::Gap { .. }) = answer {
            apply_retrying(&state, numbered(report("w", &held), next()))
                .await
                .unwrap();
        } else {
            answer.unwrap();
        }
    }
    let joined = State::open(settings(&watch, min_replicas)).await.unwrap();
    wait::until_ok(
        "a replica that joins after the failover converges",
        || async {
            joined.check()?;
            match joined.digest() == state.digest() {
                true => Ok(()),
                false => Err(ChangeError::NotReady),
            }
        },
    )
    .await;
    let claims = |s: &State| (s.held(&revoked), s.held(&held));
    let result = (claims(&state), claims(&joined));
    state.stop().await;
    joined.stop().await;
    Some(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_follows_a_failover_and_with_min_replicas_loses_nothing() {
    let Some(claims) = failover(1).await else {
        return;
    };
    assert_eq!(
        claims,
        ((0, 30), (0, 30)),
        "exactly what the worker holds, on both"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_follows_a_failover_without_min_replicas_and_over_claims_nothing() {
    let Some(((over, held), joined)) = failover(0).await else {
        return;
    };
    // What the failover lost may be under-claimed; nothing revoked is claimed.
    assert_eq!(over, 0, "over-claimed");
    assert!(held <= 30);
    assert_eq!((over, held), joined, "both replicas alike");
}
