//! The workers' own cache views as a prefix source, for benchmarks: each routable worker is
//! asked `POST /cache_prefix` with the prompt's block hashes (served by `kv-indexer-sim`, not
//! by SGLang) and answers how many leading pages it holds on the device and then on the host.
//! A worker that does not answer in time counts as holding nothing.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::Value;

use crate::workers::Workers;

/// How long a worker may take to describe its cache.
const TIMEOUT: Duration = Duration::from_secs(1);

/// Leading pages a worker holds, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedPrefix {
    pub device_pages: usize,
    pub host_pages: usize,
}

/// Every answering worker of `routable` with its cached prefix of `hashes`.
pub async fn cached_prefixes(
    http: &reqwest::Client,
    workers: &Workers,
    routable: &[usize],
    hashes: &[i64],
) -> Vec<(usize, CachedPrefix)> {
    let body = serde_json::json!({ "hashes": hashes }).to_string();
    let asks = routable.iter().map(|&worker| {
        let request = http
            .post(format!("{}/cache_prefix", workers.list[worker].url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .timeout(TIMEOUT);
        async move {
            let bytes = request.send().await.ok()?.bytes().await.ok()?;
            let answer: Value = serde_json::from_slice(&bytes).ok()?;
            let pages = |key: &str| answer[key].as_u64().map(|n| n as usize);
            Some((
                worker,
                CachedPrefix {
                    device_pages: pages("device_pages")?,
                    host_pages: pages("host_pages")?,
                },
            ))
        }
    });
    join_all(asks).await.into_iter().flatten().collect()
}
