//! The msgpack batch decoder, from any bytes: decoding never panics, and whatever decodes maps
//! and splits into apply messages the server accepts (a bridge never sends a batch the Indexer
//! would reject as INVALID_ARGUMENT, which would stop it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use kv_indexer_proto::convert;
use sgl_kv_indexer_fuzz::bridge_messages;

fuzz_target!(|payload: &[u8]| {
    for message in bridge_messages(payload, "worker-0").unwrap_or_default() {
        let request = convert::apply_request(message);
        if let Err(error) = request.clone().validate() {
            panic!("a decodable batch mapped to a rejected apply: {error}\n{request:?}");
        }
    }
});
