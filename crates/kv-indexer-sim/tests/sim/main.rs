//! The simulated worker's tests, one binary: its engine, events, HTTP API, publisher, vLLM
//! mode, and the whole worker end to end.

mod e2e;
mod engine;
mod events;
mod http;
mod publisher;
mod vllm;
