//! One worker group's block hashing, whichever engine it runs: SGLang's ([`crate::hashing`]) or
//! vLLM's ([`crate::vllm_hashing`]). The two are different hash spaces: an SGLang hash and a
//! vLLM hash of the same tokens never meet, so one Indexer holds both fleets apart.

use crate::hashing::{HashConfig, hash_into};
use crate::vllm_hashing::{ExtraKeys, VllmHasher};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockHasher {
    Sglang(HashConfig),
    Vllm(VllmHasher),
}

impl BlockHasher {
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        match self {
            BlockHasher::Sglang(config) => config.block_size,
            BlockHasher::Vllm(hasher) => hasher.block_size(),
        }
    }

    /// `sglang` or `vllm`.
    pub fn engine(&self) -> &'static str {
        match self {
            BlockHasher::Sglang(_) => "sglang",
            BlockHasher::Vllm(_) => "vllm",
        }
    }

    /// Whether units are token bigrams (SGLang's speculative engines).
    pub fn bigram(&self) -> bool {
        matches!(self, BlockHasher::Sglang(HashConfig { bigram: true, .. }))
    }

    /// The hashes of `tokens` as the engine publishes them: SGLang's include a partial last
    /// block (which can never match), vLLM hashes full blocks only.
    pub fn block_hashes(&self, tokens: &[u64], cache_salt: Option<&str>) -> Vec<i64> {
        match self {
            BlockHasher::Sglang(config) => {
                let mut hashes = Vec::new();
                hash_into(tokens, *config, cache_salt, &mut hashes);
                hashes
            }
            BlockHasher::Vllm(hasher) => hasher.block_hashes(
                tokens,
                ExtraKeys {
                    lora: None,
                    cache_salt,
                },
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm_hashing::VllmHashAlgo;

    #[test]
    fn each_engine_hashes_its_own_way() {
        let tokens: Vec<u64> = (0..40).collect();
        let sglang = BlockHasher::Sglang(HashConfig {
            block_size: 16,
            bigram: false,
        });
        let vllm = BlockHasher::Vllm(VllmHasher::new(VllmHashAlgo::Sha256, 16, None).unwrap());
        assert_eq!(
            sglang.block_hashes(&tokens, None).len(),
            3,
            "a partial last block"
        );
        let vllm_hashes = vllm.block_hashes(&tokens, None);
        assert_eq!(vllm_hashes.len(), 2, "full blocks only");
        let sglang_hashes = sglang.block_hashes(&tokens, None);
        assert!(vllm_hashes.iter().all(|h| !sglang_hashes.contains(h)));
        assert_ne!(vllm.block_hashes(&tokens, Some("salt")), vllm_hashes);
        assert_eq!((sglang.engine(), vllm.engine()), ("sglang", "vllm"));
        assert_eq!(vllm.block_size(), 16);
    }
}
