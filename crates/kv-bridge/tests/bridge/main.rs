//! The bridge's tests, one binary: SGLang's events end to end into a real server (`events`)
//! and vLLM's (`vllm`). `outage.rs` is a binary of its own: it captures the bridge's log lines
//! with a subscriber of its thread, which other tests' threads in the same process disturb
//! (tracing's callsite interest is process-wide).

mod events;
mod vllm;
