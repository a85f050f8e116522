//! What needs the shipped binaries, one test binary: each binary's start-up, settings, metrics
//! and failures (`binaries`), `kv-indexer-ctl` against a server (`ctl`), and TLS and tokens
//! with the real bridge (`access`).

mod access;
mod binaries;
mod ctl;
