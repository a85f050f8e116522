//! A real `redis-server` for the fleet tests, on a free loopback port, in a directory of its
//! own. `scripts/install_redis.sh` (run by `.ci/run`) installs Debian's package; without the
//! binary a test skips with a message, except under CI (`CI` set), where it fails.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`; killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// Append-only file on: a restart keeps the data.
    aof: bool,
    /// The port of the primary this one replicates (`--replicaof`), if any.
    primary: Option<u16>,
}

impl RedisServer {
    /// Starts one (append-only file on when `aof`); none when the binary is missing outside CI.
    pub fn start(aof: bool) -> Option<RedisServer> {
        RedisServer::start_with(aof, None)
    }

    /// Starts a replica of `primary` (`--replicaof`), without an append-only file.
    pub fn start_replica_of(primary: &RedisServer) -> Option<RedisServer> {
        RedisServer::start_with(false, Some(primary.port))
    }

    fn start_with(aof: bool, primary: Option<u16>) -> Option<RedisServer> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(
                std::env::var_os("CI").is_none(),
                "redis-server is missing under CI: scripts/install_redis.sh installs it"
            );
            eprintln!(
                "SKIPPED: redis-server is not installed (scripts/install_redis.sh installs it)"
            );
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = std::env::temp_dir().join(format!("kv-redis-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the redis directory");
        let mut server = RedisServer {
            child: None,
            port,
            dir,
            aof,
            primary,
        };
        server.spawn();
        Some(server)
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--daemonize", "no", "--protected-mode", "no"])
            .args(["--appendonly", if self.aof { "yes" } else { "no" }])
            .args(["--appendfsync", "everysec"])
            .args(match self.primary {
                Some(port) => vec![
                    "--replicaof".to_owned(),
                    "127.0.0.1".into(),
                    port.to_string(),
                ],
                None => Vec::new(),
            })
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.ping().is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    fn ping(&self) -> redis::RedisResult<()> {
        redis::cmd("PING").query(&mut self.connection()?)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Runs a command (`FLUSHALL`, `DEL key`, …) and returns its answer.
    pub fn command(&self, args: &[&str]) -> redis::Value {
        let mut command = redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        command
            .query(&mut self.connection().expect("connecting to redis-server"))
            .expect("a redis command")
    }

    /// Kills the server (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
