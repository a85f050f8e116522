//! kv-events' tests, one binary: decoding (`decode`), mapping (`mapping`), chunking
//! (`chunk`), ZMQ frames (`frames`), the golden vectors of the real publisher (`golden`), vLLM's
//! events (`vllm`) and the fuzz corpus replayed (`fuzz`).

mod chunk;
mod common;
mod decode;
mod frames;
mod fuzz;
mod golden;
mod mapping;
mod vllm;
