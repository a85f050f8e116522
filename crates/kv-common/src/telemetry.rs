//! The log subscriber and the Prometheus recorder every binary installs.
//!
//! The recorder is process-global (the `metrics` facade). Histogram samples are kept until an
//! upkeep folds them into buckets; `install_recorder` leaves that to its caller, so
//! [`Metrics::install`] always starts an upkeep task beside the handle: a process that nobody
//! scrapes keeps flat memory. What it adds to every series and which buckets each histogram
//! gets is its [`Exposition`].

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// How often the upkeep folds histogram samples into their buckets.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

pub use crate::buckets::{SECONDS_1MS_TO_60S, SECONDS_10US_TO_1S};

/// Logs to stderr with `RUST_LOG` as the filter (default `info`), coloured on a terminal only.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        // Colours only on a terminal: `docker logs` and log shippers get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Why metrics could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("setting the buckets of {metric}")]
    Buckets {
        metric: &'static str,
        #[source]
        source: BuildError,
    },
    #[error("installing the metrics recorder")]
    Install(#[source] BuildError),
    #[error("binding {setting} {addr}")]
    Bind {
        setting: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving metrics")]
    Serve(#[source] std::io::Error),
}

/// The process's resident memory, CPU seconds, open and maximum descriptors, threads and start
/// time (`process_*`, read from `/proc` at each scrape), as every binary exports them.
fn process_metrics() -> &'static metrics_process::Collector {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// How the recorder exposes what it records.
#[derive(Debug, Clone, Copy, Default)]
pub struct Exposition<'a> {
    /// Histogram buckets per metric name; a histogram without is rendered as a summary.
    pub buckets: &'a [(&'static str, &'a [f64])],
    /// Labels every series carries (`name`, `value`), such as the bridge's `worker`.
    pub labels: &'a [(&'static str, &'a str)],
}

/// The installed recorder's handle.
#[derive(Clone)]
pub struct Metrics {
    handle: PrometheusHandle,
}

impl Metrics {
    /// Installs the global recorder once per process (later calls return the first one; their
    /// `exposition` is ignored) and spawns its upkeep on the current runtime until `stop`.
    pub fn install(
        exposition: Exposition<'_>,
        stop: &CancellationToken,
    ) -> Result<Metrics, MetricsError> {
        static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
        if let Some(handle) = HANDLE.get() {
            return Ok(Metrics {
                handle: handle.clone(),
            });
        }
        let mut builder = PrometheusBuilder::new();
        for &(metric, bounds) in exposition.buckets {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(metric.into()), bounds)
                .map_err(|source| MetricsError::Buckets { metric, source })?;
        }
        for &(name, value) in exposition.labels {
            builder = builder.add_global_label(name, value);
        }
        let handle = builder.install_recorder().map_err(MetricsError::Install)?;
        let handle = HANDLE.get_or_init(|| handle).clone();
        process_metrics().describe();
        process_metrics().collect();
        tokio::spawn(upkeep(handle.clone(), stop.clone()));
        Ok(Metrics { handle })
    }

    /// The exposition text, the process's own metrics read afresh.
    pub fn render(&self) -> String {
        process_metrics().collect();
        self.handle.render()
    }

    /// Serves `GET /metrics` (and `pages`) on `listener` until `stop`.
    pub async fn serve(
        self,
        listener: TcpListener,
        pages: Vec<Page>,
        stop: CancellationToken,
    ) -> Result<(), MetricsError> {
        let mut app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let metrics = self.clone();
                async move { metrics.render() }
            }),
        );
        for page in pages {
            let render = page.render;
            app = app.route(
                page.path,
                axum::routing::get(move || {
                    let render = render.clone();
                    async move {
                        tokio::task::spawn_blocking(move || render())
                            .await
                            .unwrap_or_else(|_| "page failed".to_string())
                    }
                }),
            );
        }
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .map_err(MetricsError::Serve)
    }
}

async fn upkeep(handle: PrometheusHandle, stop: CancellationToken) {
    let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => handle.run_upkeep(),
            () = stop.cancelled() => return,
        }
    }
}

/// Another admin page: `GET path` answers what `render` returns (run on the blocking pool).
#[derive(Clone)]
pub struct Page {
    pub path: &'static str,
    pub render: std::sync::Arc<dyn Fn() -> String + Send + Sync>,
}

/// Binds an admin address; `setting` names the variable the binary read it from.
pub async fn bind(setting: &'static str, addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind {
            setting,
            addr,
            source,
        })
}

/// Installs the recorder, binds `addr` and serves `/metrics` (and `pages`) there until `stop`:
/// what a binary with a metrics setting does at start.
pub async fn serve_on(
    setting: &'static str,
    addr: SocketAddr,
    exposition: Exposition<'_>,
    pages: Vec<Page>,
    stop: &CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), MetricsError>>, MetricsError> {
    let listener = bind(setting, addr).await?;
    let metrics = Metrics::install(exposition, stop)?;
    tracing::info!(%addr, "serving metrics on /metrics");
    Ok(tokio::spawn(metrics.serve(listener, pages, stop.clone())))
}
