//! Prompt text to token ids: a Hugging Face `tokenizer.json` when one is given (feature
//! `hf-tokenizer`, on by default), else `kv_indexer_client::tokenize::simple_tokenize`, the
//! word tokenizer the project's router and tools share, so that the same text hashes to the
//! same blocks everywhere.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load the tokenizer {path}")]
    Load {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("built without the hf-tokenizer feature: --tokenizer-path {path} cannot be used")]
    Unsupported { path: PathBuf },
    #[error("cannot tokenize the prompt")]
    Encode(#[source] Box<dyn std::error::Error + Send + Sync>),
}

#[derive(Debug)]
pub enum Tokenizer {
    /// One token per whitespace-separated word.
    Words,
    #[cfg(feature = "hf-tokenizer")]
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The tokenizer at `path` (a `tokenizer.json`, or a directory holding one), or the word
    /// tokenizer when there is none.
    pub fn load(path: Option<&Path>) -> Result<Tokenizer, TokenizerError> {
        let Some(path) = path else {
            return Ok(Tokenizer::Words);
        };
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        #[cfg(feature = "hf-tokenizer")]
        {
            tokenizers::Tokenizer::from_file(&file)
                .map(|tokenizer| Tokenizer::HuggingFace(Box::new(tokenizer)))
                .map_err(|source| TokenizerError::Load { path: file, source })
        }
        #[cfg(not(feature = "hf-tokenizer"))]
        {
            Err(TokenizerError::Unsupported { path: file })
        }
    }

    /// Token ids of `text`. A Hugging Face tokenizer adds its special tokens, as SGLang's
    /// tokenizer manager does for a text prompt.
    pub fn encode(&self, text: &str) -> Result<Vec<u64>, TokenizerError> {
        match self {
            Tokenizer::Words => Ok(kv_indexer_client::tokenize::simple_tokenize(text)),
            #[cfg(feature = "hf-tokenizer")]
            Tokenizer::HuggingFace(tokenizer) => {
                let encoding = tokenizer
                    .encode(text, true)
                    .map_err(TokenizerError::Encode)?;
                Ok(encoding.get_ids().iter().map(|&id| u64::from(id)).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_path_splits_words_as_the_shared_tokenizer_does() {
        let tokenizer = Tokenizer::load(None).unwrap();
        let text = "the quick  brown\tfox";
        assert_eq!(
            tokenizer.encode(text).unwrap(),
            kv_indexer_client::tokenize::simple_tokenize(text)
        );
        assert_eq!(tokenizer.encode(text).unwrap().len(), 4);
    }

    #[cfg(feature = "hf-tokenizer")]
    #[test]
    fn loads_a_tokenizer_json_from_a_file_or_its_directory() {
        let dir = std::env::temp_dir().join(format!("kv-indexer-sim-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
            "decoder":null,"model":{"type":"WordLevel","vocab":{"hello":0,"world":1,"[UNK]":2},
            "unk_token":"[UNK]"}}"#;
        std::fs::write(dir.join("tokenizer.json"), json).unwrap();
        for path in [dir.clone(), dir.join("tokenizer.json")] {
            let tokenizer = Tokenizer::load(Some(&path)).unwrap();
            assert_eq!(tokenizer.encode("hello world again").unwrap(), [0, 1, 2]);
        }
        let missing = Tokenizer::load(Some(&dir.join("missing.json"))).unwrap_err();
        assert!(matches!(missing, TokenizerError::Load { .. }), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
