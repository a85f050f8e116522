//! The msgpack batch decoder, from any bytes and as either engine (SGLang, vLLM): decoding never
//! panics, and whatever decodes maps
//! and splits into apply messages the server accepts (a bridge never sends a batch the Indexer
//! would reject as INVALID_ARGUMENT, which would stop it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use kv_indexer_proto::convert;
use kv_events::Engine;
use sgl_kv_indexer_fuzz::engine_messages;

fuzz_target!(|payload: &[u8]| {
    for engine in [Engine::Sglang, Engine::Vllm] {
        for message in engine_messages(engine, payload, "worker-0").unwrap_or_default() {
            let request = convert::apply_request(message);
            if let Err(error) = request.clone().validate() {
                panic!("a decodable {engine:?} batch mapped to a rejected apply: {error}\n{request:?}");
            }
        }
    }
});
