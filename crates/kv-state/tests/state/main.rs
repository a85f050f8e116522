//! kv-state's tests, one binary, through its own API (no gRPC): the cell's atomicity, a durable
//! directory, the sequence gate, rollbacks, replicas on a real redis-server (and Sentinel), and
//! Redis's TLS and passwords.

mod cell_atomicity;
mod common;
mod durable;
mod fleet;
mod gate;
mod redis_security;
mod replicas;
mod rollback;
mod sentinel;
