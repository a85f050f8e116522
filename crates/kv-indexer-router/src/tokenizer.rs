//! Turning prompt text into token ids: the built-in deterministic tokenizer (the simulated
//! worker's), or a HuggingFace `tokenizer.json`.

use std::path::Path;

use kv_indexer_client::tokenize::simple_tokenize;

pub enum Tokenizer {
    Simple,
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Loads `path` (a `tokenizer.json` or a directory holding one), or the built-in one.
    pub fn load(path: Option<&Path>) -> Result<Tokenizer, String> {
        let Some(path) = path else {
            return Ok(Tokenizer::Simple);
        };
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        tokenizers::Tokenizer::from_file(&file)
            .map(|t| Tokenizer::HuggingFace(Box::new(t)))
            .map_err(|error| format!("--tokenizer-path {}: {error}", file.display()))
    }

    pub fn encode(&self, text: &str) -> Vec<u64> {
        match self {
            Tokenizer::Simple => simple_tokenize(text),
            Tokenizer::HuggingFace(tokenizer) => match tokenizer.encode(text, false) {
                Ok(encoding) => encoding.get_ids().iter().map(|&id| u64::from(id)).collect(),
                Err(_) => simple_tokenize(text),
            },
        }
    }
}
