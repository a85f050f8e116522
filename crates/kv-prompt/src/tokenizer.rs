//! Prompt text to token ids, the one way for the router and the simulated worker: a Hugging
//! Face `tokenizer.json` (feature `hf`), or the built-in word tokenizer
//! ([`crate::tokenize::simple_tokenize`]) when no path is given.
//!
//! A Hugging Face tokenizer encodes with its special tokens added (`encode(text, true)`), as
//! SGLang's tokenizer manager does for a text prompt: a router that left out a BOS token would
//! hash blocks no worker holds. A tokenizer that cannot load, or cannot encode a probe text, is
//! refused at start; an encode error later is an error for that request, never a fallback to
//! another tokenizer.

use std::path::{Path, PathBuf};

/// Why a tokenizer cannot be used. `setting` names the flag and variable the binary read the
/// path from.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{setting} {path}: cannot load the tokenizer")]
    Load {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{setting} {path}: the tokenizer loads but cannot encode text")]
    Probe {
        setting: &'static str,
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{setting} {path}: built without the `hf` feature, a tokenizer.json cannot be used")]
    Unsupported {
        setting: &'static str,
        path: PathBuf,
    },
    #[error("cannot tokenize the prompt")]
    Encode(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Text the tokenizer must encode at load, so that a broken one stops start-up.
#[cfg(feature = "hf")]
const PROBE: &str = "The quick brown fox";

#[derive(Debug)]
pub enum Tokenizer {
    /// One token per whitespace-separated word.
    Words,
    #[cfg(feature = "hf")]
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The tokenizer at `path` (a `tokenizer.json`, or a directory holding one), or the word
    /// tokenizer when there is none. `setting` is how the binary names the path in errors,
    /// e.g. `"--tokenizer-path (KV_ROUTER_TOKENIZER_PATH)"`.
    pub fn load(setting: &'static str, path: Option<&Path>) -> Result<Tokenizer, TokenizerError> {
        let Some(path) = path else {
            return Ok(Tokenizer::Words);
        };
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        Tokenizer::load_file(setting, file)
    }

    #[cfg(feature = "hf")]
    fn load_file(setting: &'static str, path: PathBuf) -> Result<Tokenizer, TokenizerError> {
        let tokenizer = match tokenizers::Tokenizer::from_file(&path) {
            Ok(tokenizer) => tokenizer,
            Err(source) => {
                return Err(TokenizerError::Load {
                    setting,
                    path,
                    source,
                });
            }
        };
        if let Err(source) = tokenizer.encode(PROBE, true) {
            return Err(TokenizerError::Probe {
                setting,
                path,
                source,
            });
        }
        Ok(Tokenizer::HuggingFace(Box::new(tokenizer)))
    }

    #[cfg(not(feature = "hf"))]
    fn load_file(setting: &'static str, path: PathBuf) -> Result<Tokenizer, TokenizerError> {
        Err(TokenizerError::Unsupported { setting, path })
    }

    /// Token ids of `text`, special tokens included.
    pub fn encode(&self, text: &str) -> Result<Vec<u64>, TokenizerError> {
        self.encode_with(text, true)
    }

    /// Token ids of a rendered chat template: no special tokens added, as
    /// `apply_chat_template(tokenize=True)` encodes (the template writes its own BOS).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u64>, TokenizerError> {
        self.encode_with(text, false)
    }

    #[cfg_attr(not(feature = "hf"), allow(unused_variables))]
    fn encode_with(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u64>, TokenizerError> {
        match self {
            // Words have no special tokens.
            Tokenizer::Words => Ok(crate::tokenize::simple_tokenize(text)),
            #[cfg(feature = "hf")]
            Tokenizer::HuggingFace(tokenizer) => {
                let encoding = tokenizer
                    .encode(text, add_special_tokens)
                    .map_err(TokenizerError::Encode)?;
                Ok(encoding.get_ids().iter().map(|&id| u64::from(id)).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTING: &str = "--tokenizer-path (KV_TEST_TOKENIZER_PATH)";

    #[test]
    fn without_a_path_splits_words_as_the_shared_tokenizer_does() {
        let tokenizer = Tokenizer::load(SETTING, None).unwrap();
        let text = "the quick  brown\tfox";
        assert_eq!(
            tokenizer.encode(text).unwrap(),
            crate::tokenize::simple_tokenize(text)
        );
        assert_eq!(tokenizer.encode(text).unwrap().len(), 4);
    }

    #[cfg(not(feature = "hf"))]
    #[test]
    fn without_the_feature_a_path_is_refused_naming_the_setting() {
        let error = Tokenizer::load(SETTING, Some(Path::new("tokenizer.json"))).unwrap_err();
        assert!(matches!(error, TokenizerError::Unsupported { .. }));
        assert!(
            error.to_string().contains("KV_TEST_TOKENIZER_PATH"),
            "{error}"
        );
    }

    #[cfg(feature = "hf")]
    mod hf {
        use super::*;
        use crate::hashing::{HashConfig, block_hashes};

        use kv_testkit::tokenizer::BosTokenizer;

        #[test]
        fn loads_a_tokenizer_json_from_a_file_or_its_directory() {
            let written = BosTokenizer::write("client-load", 8);
            for path in [&written.dir, &written.path] {
                let tokenizer = Tokenizer::load(SETTING, Some(path)).unwrap();
                assert!(matches!(tokenizer, Tokenizer::HuggingFace(_)));
            }
        }

        #[test]
        fn refuses_a_missing_or_broken_file_naming_the_setting() {
            let written = BosTokenizer::write("client-broken", 8);
            std::fs::write(&written.path, "{not json").unwrap();
            for path in [written.dir.join("missing.json"), written.dir.clone()] {
                let error = Tokenizer::load(SETTING, Some(&path)).unwrap_err();
                assert!(matches!(error, TokenizerError::Load { .. }), "{error}");
                assert!(
                    error.to_string().contains("KV_TEST_TOKENIZER_PATH"),
                    "{error}"
                );
                assert!(std::error::Error::source(&error).is_some());
            }
        }

        #[test]
        fn adds_the_bos_token_as_sglang_does() {
            let written = BosTokenizer::write("client-bos", 8);
            let tokenizer = Tokenizer::load(SETTING, Some(&written.path)).unwrap();
            let bos = u64::from(written.bos);
            assert_eq!(tokenizer.encode("w0 w1 w7").unwrap(), [bos, 0, 1, 7]);
            assert_eq!(tokenizer.encode("").unwrap(), [bos]);
        }

        /// What the router did before sharing this tokenizer (`encode(text, false)`) gives
        /// block hashes no worker holds.
        #[test]
        fn leaving_out_special_tokens_would_hash_different_blocks() {
            let written = BosTokenizer::write("client-old", 64);
            let text: String = (0..64).map(|i| format!("w{i} ")).collect();
            let Tokenizer::HuggingFace(raw) =
                Tokenizer::load(SETTING, Some(&written.path)).unwrap()
            else {
                panic!("a tokenizer.json loads as Hugging Face");
            };
            let without: Vec<u64> = raw
                .encode(text.as_str(), false)
                .unwrap()
                .get_ids()
                .iter()
                .map(|&id| u64::from(id))
                .collect();
            let with = Tokenizer::HuggingFace(raw).encode(&text).unwrap();
            let config = HashConfig {
                block_size: 16,
                bigram: false,
            };
            let (old, new) = (
                block_hashes(&without, config, None),
                block_hashes(&with, config, None),
            );
            // 64 words are four pages; <s> starts a fifth.
            assert_eq!((old.len(), new.len()), (4, 5));
            assert!(
                old.iter().all(|hash| !new.contains(hash)),
                "no block of the old hashing is one the worker holds"
            );
        }
    }
}
