//! A tiny real Hugging Face `tokenizer.json` that adds a BOS token, as most LLM tokenizers do:
//! a WordLevel model over the words `w0 … w{n-1}`, a whitespace pre-tokenizer, and a
//! TemplateProcessing post-processor that puts `<s>` before every single sequence. Written by
//! the test; nothing is downloaded.

use std::path::PathBuf;

use serde_json::{Map, Value, json};

/// The id of `<s>` in a tokenizer of `words` words (after the words, before `[UNK]`).
pub fn bos_id(words: u32) -> u32 {
    words
}

/// The tokenizer's JSON.
pub fn bos_tokenizer_json(words: u32) -> Value {
    let mut vocab: Map<String, Value> = (0..words).map(|i| (format!("w{i}"), json!(i))).collect();
    vocab.insert("<s>".into(), json!(bos_id(words)));
    vocab.insert("[UNK]".into(), json!(words + 1));
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": bos_id(words), "content": "<s>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}}
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos_id(words)], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

/// The tokenizer written to `tokenizer.json` in a directory of its own under the system's
/// temporary directory, removed on drop.
pub struct BosTokenizer {
    pub dir: PathBuf,
    /// `dir/tokenizer.json`.
    pub path: PathBuf,
    pub bos: u32,
}

impl BosTokenizer {
    /// Writes a tokenizer of `words` words; `name` keeps directories of concurrent tests apart.
    pub fn write(name: &str, words: u32) -> BosTokenizer {
        let dir = std::env::temp_dir().join(format!(
            "kv-testkit-tokenizer-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|error| panic!("creating {}: {error}", dir.display()));
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, bos_tokenizer_json(words).to_string())
            .unwrap_or_else(|error| panic!("writing {}: {error}", path.display()));
        BosTokenizer {
            dir,
            path,
            bos: bos_id(words),
        }
    }
}

impl Drop for BosTokenizer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
