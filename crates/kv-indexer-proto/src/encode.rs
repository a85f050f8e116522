//! A hand-written encoder for the one hot response, `MatchExternalKvPrefixResponse`: the server
//! writes it straight from the index's interned worker strings, without building a message (two
//! `String`s per match) for prost to encode. Byte for byte what prost writes for the same
//! message (fields in number order, defaults omitted), which the tests check.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, encode_varint, encoded_len_varint, skip_field};

/// An encoded `MatchExternalKvPrefixResponse`, sent as is: a [`prost::Message`] whose encoding
/// is its bytes, so that tonic's prost codec can carry it. Decoding one is not supported (it
/// stays empty); clients decode the generated message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedPrefixResponse(Vec<u8>);

impl EncodedPrefixResponse {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl prost::Message for EncodedPrefixResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// One `ExternalKvPrefixMatch`, by reference.
#[derive(Debug, Clone, Copy)]
pub struct PrefixMatchRef<'a> {
    pub worker_address: &'a str,
    pub matched_prefix_blocks: u32,
    pub worker_id: &'a str,
}

// Field keys: (field number << 3) | wire type (0 varint, 2 length-delimited).
const RESPONSE_MATCHES: u8 = (1 << 3) | 2;
const RESPONSE_BEST: u8 = 2 << 3;
const RESPONSE_BLOCKS_READ: u8 = 3 << 3;
const MATCH_ADDRESS: u8 = (1 << 3) | 2;
const MATCH_BLOCKS: u8 = 2 << 3;
const MATCH_ID: u8 = (3 << 3) | 2;

/// Encodes a `MatchExternalKvPrefixResponse`. `matches` is walked twice (sizes, then bytes), so
/// the buffer is allocated once at its exact size.
pub fn prefix_response<'a, I>(
    matches: I,
    best_prefix_blocks: u32,
    blocks_read: u32,
) -> EncodedPrefixResponse
where
    I: Iterator<Item = PrefixMatchRef<'a>> + Clone,
{
    let mut len = varint_field_len(best_prefix_blocks) + varint_field_len(blocks_read);
    for m in matches.clone() {
        let inner = match_len(&m);
        len += 1 + encoded_len_varint(inner as u64) + inner;
    }
    let mut buf = Vec::with_capacity(len);
    for m in matches {
        buf.put_u8(RESPONSE_MATCHES);
        encode_varint(match_len(&m) as u64, &mut buf);
        put_string(&mut buf, MATCH_ADDRESS, m.worker_address);
        put_varint(&mut buf, MATCH_BLOCKS, m.matched_prefix_blocks);
        put_string(&mut buf, MATCH_ID, m.worker_id);
    }
    put_varint(&mut buf, RESPONSE_BEST, best_prefix_blocks);
    put_varint(&mut buf, RESPONSE_BLOCKS_READ, blocks_read);
    debug_assert_eq!(buf.len(), len);
    EncodedPrefixResponse(buf)
}

/// The encoded length of one match's fields.
fn match_len(m: &PrefixMatchRef<'_>) -> usize {
    string_field_len(m.worker_address)
        + varint_field_len(m.matched_prefix_blocks)
        + string_field_len(m.worker_id)
}

fn string_field_len(value: &str) -> usize {
    if value.is_empty() {
        0
    } else {
        1 + encoded_len_varint(value.len() as u64) + value.len()
    }
}

fn varint_field_len(value: u32) -> usize {
    if value == 0 {
        0
    } else {
        1 + encoded_len_varint(u64::from(value))
    }
}

fn put_string(buf: &mut Vec<u8>, key: u8, value: &str) {
    if !value.is_empty() {
        buf.put_u8(key);
        encode_varint(value.len() as u64, buf);
        buf.put_slice(value.as_bytes());
    }
}

fn put_varint(buf: &mut Vec<u8>, key: u8, value: u32) {
    if value != 0 {
        buf.put_u8(key);
        encode_varint(u64::from(value), buf);
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1 as pb;

    /// `(worker_address, matched_prefix_blocks, worker_id)`.
    type Match<'a> = (&'a str, u32, &'a str);

    fn generic(
        matches: &[(&str, u32, &str)],
        best: u32,
        read: u32,
    ) -> pb::MatchExternalKvPrefixResponse {
        pb::MatchExternalKvPrefixResponse {
            matches: matches
                .iter()
                .map(|&(address, blocks, id)| pb::ExternalKvPrefixMatch {
                    worker_address: address.to_owned(),
                    matched_prefix_blocks: blocks,
                    worker_id: id.to_owned(),
                })
                .collect(),
            best_prefix_blocks: best,
            blocks_read: read,
        }
    }

    fn hand(matches: &[Match<'_>], best: u32, read: u32) -> EncodedPrefixResponse {
        let refs = matches
            .iter()
            .map(
                |&(worker_address, matched_prefix_blocks, worker_id)| PrefixMatchRef {
                    worker_address,
                    matched_prefix_blocks,
                    worker_id,
                },
            );
        prefix_response(refs, best, read)
    }

    #[test]
    fn writes_exactly_what_prost_writes() {
        let long = "w".repeat(300);
        let cases: Vec<(Vec<Match<'_>>, u32, u32)> = vec![
            (vec![], 0, 0),
            (vec![], 0, 1),
            (vec![("10.0.0.1:30000", 3, "worker-a")], 3, 4),
            (
                vec![
                    ("http://a:1", 1 << 20, "é-worker"),
                    ("b", 127, ""),
                    ("c", 128, "id"),
                ],
                1 << 20,
                u32::MAX,
            ),
            (
                vec![(long.as_str(), 16_384, long.as_str()), ("", 0, "")],
                16_384,
                16_384,
            ),
        ];
        for (matches, best, read) in cases {
            let expected = generic(&matches, best, read);
            let encoded = hand(&matches, best, read);
            assert_eq!(encoded.as_bytes(), expected.encode_to_vec(), "{matches:?}");
            assert_eq!(encoded.encoded_len(), expected.encoded_len());
            let decoded = pb::MatchExternalKvPrefixResponse::decode(encoded.as_bytes()).unwrap();
            assert_eq!(decoded, expected);
        }
    }

    #[test]
    fn the_wrapper_encodes_as_its_bytes() {
        let encoded = hand(&[("a", 2, "b")], 2, 2);
        let mut framed = Vec::new();
        encoded.encode(&mut framed).unwrap();
        assert_eq!(framed, encoded.as_bytes());
    }
}
