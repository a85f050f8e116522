//! The client library's tests, one binary: the client against servers (`client`), SGLang's
//! block hashing (`hashing`) and vLLM's (`vllm_hashing`), against golden vectors.

mod client;
mod hashing;
mod vllm_hashing;
