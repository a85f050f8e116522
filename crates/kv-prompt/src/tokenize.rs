//! A deterministic stand-in tokenizer for tools and simulations, shared by the CLI, the
//! simulated worker and the router so that the same text gives the same token ids and hence
//! the same block hashes everywhere.
//!
//! Each whitespace-separated word (Unicode whitespace, as `str::split_whitespace`) becomes one
//! token: the 64-bit FNV-1a hash of its UTF-8 bytes, keeping the low 31 bits, so every id is
//! below 2^31 (and so fits SGLang's u32 page hashing). It is stable across platforms and
//! releases; it is not a real tokenizer (distinct words may collide, one in ~2^31 per pair).

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const TOKEN_MASK: u64 = (1 << 31) - 1;

/// The token ids of `text`, one per whitespace-separated word.
pub fn simple_tokenize(text: &str) -> Vec<u64> {
    text.split_whitespace().map(word_token).collect()
}

fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET_BASIS, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME)
    })
}

fn word_token(word: &str) -> u64 {
    fnv1a_64(word.as_bytes()) & TOKEN_MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expect: &[u64]) {
        assert_eq!(simple_tokenize(text), expect, "text {text:?}");
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn maps_each_word_to_the_low_31_bits_of_its_hash() {
        check("", &[]);
        check("   \n\t ", &[]);
        check("a", &[0x0601_ec8c]);
        check("foobar", &[0x7739_67e8]);
        check(" a\tfoobar\n a ", &[0x0601_ec8c, 0x7739_67e8, 0x0601_ec8c]);
    }

    #[test]
    fn keeps_every_id_below_2_pow_31() {
        let text: String = (0..10_000).map(|i| format!("w{i} ")).collect();
        assert!(simple_tokenize(&text).iter().all(|&t| t < 1 << 31));
    }
}
