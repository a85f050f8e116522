//! The router's tests, one binary: every policy and the Indexer's failure classes over real
//! sockets (`policies`), and the whole path from simulated workers through their bridges and
//! the Indexer to the router (`e2e`). `/metrics` from start has a binary of its own
//! (`tests/metrics.rs`): it installs the process-wide recorder before anything records.

mod common;
mod e2e;
mod policies;
