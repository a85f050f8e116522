//! kv-prompt's tests, one binary: SGLang's block hashing (`hashing`) and vLLM's
//! (`vllm_hashing`), against golden vectors from the real engines (`tests/fixtures/`).

mod hashing;
mod vllm_hashing;
