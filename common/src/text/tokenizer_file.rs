//! A model folder's `tokenizer.json`, loaded.

use std::path::Path;

use tokenizers::Tokenizer;

#[derive(Debug, thiserror::Error)]
#[error("cannot load the tokenizer from {path}: {message}")]
pub struct LoadTokenizerError {
    pub path: String,
    pub message: String,
}

/// Reads `tokenizer.json` from a Hugging Face model folder, without the padding and truncation it
/// may carry (sentence-transformers' files pad every text to 128 tokens): each prompt is a request
/// of its own, and its length limits are the API's, as transformers' tokenizers apply them only when
/// asked.
pub fn load_tokenizer(model_dir: &Path) -> Result<Tokenizer, LoadTokenizerError> {
    let path = model_dir.join("tokenizer.json");
    let error = |message: String| LoadTokenizerError {
        path: path.display().to_string(),
        message,
    };
    let mut tokenizer = Tokenizer::from_file(&path).map_err(|e| error(e.to_string()))?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(None)
        .map_err(|e| error(e.to_string()))?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_padding_and_truncation_are_left_out() {
        let folder =
            std::env::temp_dir().join(format!("sluice-padded-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let vocab = serde_json::json!({"[PAD]": 0, "a": 1, "b": 2, "[UNK]": 3});
        let file = serde_json::json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        std::fs::write(folder.join("tokenizer.json"), file.to_string()).unwrap();
        let tokenizer = load_tokenizer(&folder).unwrap();
        std::fs::remove_dir_all(&folder).unwrap();
        let encoding = tokenizer.encode("a b a", true).unwrap();
        assert_eq!(encoding.get_ids(), [1, 2, 1]);
    }

    #[test]
    fn a_missing_tokenizer_file_is_a_load_error_naming_it() {
        let error = load_tokenizer(Path::new("/nonexistent/model")).unwrap_err();
        assert_eq!(error.path, "/nonexistent/model/tokenizer.json");
    }
}
