//! The wire of the one hot RPC, `MatchExternalKvPrefix`, written by hand for the server:
//! - the response is encoded straight from the index's interned worker strings, without
//!   building a message (two `String`s per match) for prost to encode: byte for byte what prost
//!   writes for the same message (fields in number order, defaults omitted);
//! - the request's packed hashes are decoded a buffer chunk at a time rather than one
//!   `get_i64_le` per hash; anything else (other fields, an unpacked or malformed list) goes
//!   through prost's own decoding, errors included;
//! - for load generators, a response can be read for its counts only
//!   ([`CountedPrefixResponse`]), so that a generator spends far less per answer than the
//!   server it drives.
//!
//! The tests check all three against prost.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, check_wire_type, decode_varint, encode_varint, encoded_len_varint,
    sfixed64, skip_field, uint32,
};

use crate::v1 as pb;

/// The gRPC path of `MatchExternalKvPrefix`.
pub const PREFIX_PATH: &str = "/kv_indexer.v1.KVIndexer/MatchExternalKvPrefix";

/// A `MatchExternalKvPrefixRequest` decoded with the fast path for its hashes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodedPrefixRequest(pub pb::MatchExternalKvPrefixRequest);

impl prost::Message for DecodedPrefixRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.0.encode_raw(buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        let at = |field| in_field("MatchExternalKvPrefixRequest", field);
        let request = &mut self.0;
        match tag {
            1 if wire_type == WireType::LengthDelimited
                && merge_packed(&mut request.hashes, buf) =>
            {
                Ok(())
            }
            1 => sfixed64::merge_repeated(wire_type, &mut request.hashes, buf, ctx)
                .map_err(at("hashes")),
            2 => uint32::merge(wire_type, &mut request.max_blocks, buf, ctx)
                .map_err(at("max_blocks")),
            100 => uint32::merge(
                wire_type,
                request.max_matches.get_or_insert_default(),
                buf,
                ctx,
            )
            .map_err(at("max_matches")),
            101 => prost::encoding::bool::merge(
                wire_type,
                request.include_predictions.get_or_insert_default(),
                buf,
                ctx,
            )
            .map_err(at("include_predictions")),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// Names the field in a decoding error, as prost's generated code does.
fn in_field(
    message: &'static str,
    field: &'static str,
) -> impl Fn(prost::DecodeError) -> prost::DecodeError {
    move |mut error| {
        error.push(message, field);
        error
    }
}

/// Appends a packed run of sfixed64 at the front of `buf` to `hashes` a chunk at a time, when
/// its length prefix is whole in the first chunk and describes whole values that `buf` holds;
/// otherwise leaves `buf` untouched and returns false (prost's path then decodes it, or names
/// what is wrong with it).
fn merge_packed(hashes: &mut Vec<i64>, buf: &mut impl Buf) -> bool {
    let mut head = buf.chunk();
    let before = head.len();
    let Ok(len) = decode_varint(&mut head) else {
        return false;
    };
    let prefix = before - head.len();
    let Ok(len) = usize::try_from(len) else {
        return false;
    };
    if len % 8 != 0 || len > buf.remaining() - prefix {
        return false;
    }
    buf.advance(prefix);
    hashes.reserve(len / 8);
    let mut left = len;
    while left > 0 {
        let chunk = buf.chunk();
        let whole = chunk.len().min(left) / 8 * 8;
        if whole == 0 {
            // A value split between two chunks.
            hashes.push(buf.get_i64_le());
            left -= 8;
            continue;
        }
        hashes.extend(
            chunk[..whole]
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))),
        );
        buf.advance(whole);
        left -= whole;
    }
    true
}

/// An encoded `MatchExternalKvPrefixResponse`, sent as is: a [`prost::Message`] whose encoding
/// is its bytes, so that tonic's prost codec can carry it. Decoding one is not supported (it
/// stays empty); clients decode the generated message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedPrefixResponse(Vec<u8>);

impl EncodedPrefixResponse {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Appends the `predicted` list (field 100, after every upstream field, as prost orders
    /// it).
    pub fn with_predicted(mut self, predicted: &[pb::ExternalKvPrefixMatch]) -> Self {
        for m in predicted {
            prost::encoding::message::encode(100, m, &mut self.0);
        }
        self
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

/// A `MatchExternalKvPrefixResponse` read for its counts: each match is checked to be a
/// length-delimited field within the body and skipped, not decoded into two `String`s. It
/// encodes as a response with that many default (empty) matches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountedPrefixResponse {
    pub matches: u32,
    pub best_prefix_blocks: u32,
    pub blocks_read: u32,
}

impl prost::Message for CountedPrefixResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        for _ in 0..self.matches {
            buf.put_slice(&[RESPONSE_MATCHES, 0]);
        }
        put_varint(buf, RESPONSE_BEST, self.best_prefix_blocks);
        put_varint(buf, RESPONSE_BLOCKS_READ, self.blocks_read);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        let at = |field| in_field("MatchExternalKvPrefixResponse", field);
        match tag {
            1 => {
                check_wire_type(WireType::LengthDelimited, wire_type).map_err(at("matches"))?;
                skip_field(wire_type, tag, buf, ctx).map_err(at("matches"))?;
                self.matches += 1;
                Ok(())
            }
            2 => uint32::merge(wire_type, &mut self.best_prefix_blocks, buf, ctx)
                .map_err(at("best_prefix_blocks")),
            3 => {
                uint32::merge(wire_type, &mut self.blocks_read, buf, ctx).map_err(at("blocks_read"))
            }
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        2 * self.matches as usize
            + varint_field_len(self.best_prefix_blocks)
            + varint_field_len(self.blocks_read)
    }

    fn clear(&mut self) {
        *self = CountedPrefixResponse::default();
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

fn put_varint(buf: &mut impl BufMut, key: u8, value: u32) {
    if value != 0 {
        buf.put_u8(key);
        encode_varint(u64::from(value), buf);
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

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
            predicted: Vec::new(),
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
    fn predictions_are_appended_as_prost_writes_them() {
        let matches = [("http://a:1", 3, "a")];
        let mut expected = generic(&matches, 3, 5);
        expected.predicted = vec![
            pb::ExternalKvPrefixMatch {
                worker_address: "http://b:2".into(),
                matched_prefix_blocks: 9,
                worker_id: String::new(),
            },
            pb::ExternalKvPrefixMatch {
                worker_address: "http://a:1".into(),
                matched_prefix_blocks: 4,
                worker_id: "a".into(),
            },
        ];
        let encoded = hand(&matches, 3, 5).with_predicted(&expected.predicted);
        assert_eq!(encoded.as_bytes(), expected.encode_to_vec());
        assert_eq!(
            hand(&matches, 3, 5).with_predicted(&[]),
            hand(&matches, 3, 5)
        );
    }

    #[test]
    fn the_wrapper_encodes_as_its_bytes() {
        let encoded = hand(&[("a", 2, "b")], 2, 2);
        let mut framed = Vec::new();
        encoded.encode(&mut framed).unwrap();
        assert_eq!(framed, encoded.as_bytes());
    }

    #[test]
    fn counts_what_prost_decodes() {
        let cases: [(Vec<Match<'_>>, u32, u32); 3] = [
            (vec![], 0, 0),
            (vec![("10.0.0.1:30000", 3, "worker-a"), ("", 0, "")], 3, 4),
            (
                (0..300).map(|_| ("http://a:1", 1 << 20, "é")).collect(),
                1 << 20,
                u32::MAX,
            ),
        ];
        for (matches, best, read) in cases {
            let bytes = generic(&matches, best, read).encode_to_vec();
            let counted = CountedPrefixResponse::decode(&bytes[..]).unwrap();
            let expected = CountedPrefixResponse {
                matches: matches.len() as u32,
                best_prefix_blocks: best,
                blocks_read: read,
            };
            assert_eq!(counted, expected);
            // Its own encoding: that many empty matches, read back the same by both.
            let encoded = counted.encode_to_vec();
            assert_eq!(encoded.len(), counted.encoded_len());
            let generic_read = pb::MatchExternalKvPrefixResponse::decode(&encoded[..]).unwrap();
            assert_eq!(generic_read.matches.len(), matches.len());
            assert_eq!(
                CountedPrefixResponse::decode(&encoded[..]).unwrap(),
                expected
            );
        }
    }

    #[test]
    fn refuses_a_truncated_or_mistyped_match() {
        let bytes = generic(&[("a", 2, "b")], 2, 2).encode_to_vec();
        let truncated = &bytes[..bytes.len() - 6];
        assert!(pb::MatchExternalKvPrefixResponse::decode(truncated).is_err());
        let error = CountedPrefixResponse::decode(truncated).unwrap_err();
        assert!(error.to_string().contains("matches"), "{error}");
        // Field 1 as a varint: prost refuses the wire type, and so does the count.
        let mistyped = [1 << 3, 5];
        assert!(pb::MatchExternalKvPrefixResponse::decode(&mistyped[..]).is_err());
        let error = CountedPrefixResponse::decode(&mistyped[..]).unwrap_err();
        assert!(error.to_string().contains("matches"), "{error}");
    }

    fn request(
        hashes: Vec<i64>,
        max_blocks: u32,
        max_matches: Option<u32>,
    ) -> pb::MatchExternalKvPrefixRequest {
        pb::MatchExternalKvPrefixRequest {
            hashes,
            max_blocks,
            max_matches,
            include_predictions: None,
        }
    }

    /// Decodes `bytes` split into a chain of two buffers at `split`, as a body can arrive.
    fn decode_split(
        bytes: &[u8],
        split: usize,
    ) -> Result<pb::MatchExternalKvPrefixRequest, prost::DecodeError> {
        let (a, b) = bytes.split_at(split.min(bytes.len()));
        DecodedPrefixRequest::decode(a.chain(b)).map(|d| d.0)
    }

    #[test]
    fn decodes_what_prost_decodes() {
        let many: Vec<i64> = (0..1000i64)
            .map(|i| i.wrapping_mul(0x0123_4567_89ab_cdef))
            .collect();
        let cases = [
            request(vec![], 0, None),
            request(vec![1], 0, None),
            request(vec![-1, i64::MIN, i64::MAX, 0], 7, Some(3)),
            request(many, u32::MAX, Some(0)),
            pb::MatchExternalKvPrefixRequest {
                include_predictions: Some(true),
                ..request(vec![4, 5], 0, None)
            },
            pb::MatchExternalKvPrefixRequest {
                include_predictions: Some(false),
                ..request(vec![4], 0, Some(1))
            },
        ];
        for expected in cases {
            let bytes = expected.encode_to_vec();
            for split in [0, 1, 2, 3, 9, 10, bytes.len() / 2, bytes.len()] {
                assert_eq!(
                    decode_split(&bytes, split).unwrap(),
                    expected,
                    "split at {split}"
                );
            }
        }
    }

    #[test]
    fn takes_unpacked_hashes_and_repeated_lists_like_prost() {
        // Field 1 as single fixed64 values (key 0x09), then a packed list, then one more.
        let mut bytes = vec![0x09];
        bytes.extend(5i64.to_le_bytes());
        let packed = request(vec![6, 7], 0, None).encode_to_vec();
        bytes.extend(&packed);
        bytes.push(0x09);
        bytes.extend(8i64.to_le_bytes());
        let expected = pb::MatchExternalKvPrefixRequest::decode(&bytes[..]).unwrap();
        assert_eq!(expected.hashes, [5, 6, 7, 8]);
        assert_eq!(decode_split(&bytes, 4).unwrap(), expected);
    }

    #[test]
    fn refuses_what_prost_refuses() {
        let good = request(vec![1, 2, 3], 0, None).encode_to_vec();
        // A packed length not a multiple of 8, one past the end, and a truncated body.
        let mut ragged = good.clone();
        ragged[1] = 23;
        ragged.truncate(25);
        let mut long = good.clone();
        long[1] = 32;
        let short = &good[..good.len() - 3];
        for bytes in [&ragged[..], &long[..], short] {
            assert!(pb::MatchExternalKvPrefixRequest::decode(bytes).is_err());
            let ours = decode_split(bytes, bytes.len()).unwrap_err();
            let theirs = pb::MatchExternalKvPrefixRequest::decode(bytes).unwrap_err();
            assert_eq!(ours.to_string(), theirs.to_string());
        }
    }
}
