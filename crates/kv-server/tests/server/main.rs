//! The server library's tests, one binary: the gRPC service in process (`server`), overload
//! and admission (`overload`), predictions (`predictions`), a durable server's restarts
//! (`durable`) and replicas on a shared log (`fleet`).

mod durable;
mod fleet;
mod overload;
mod predictions;
mod server;
