//! A model folder's `tokenizer.json`, loaded.

use std::path::Path;

use tokenizers::Tokenizer;

#[derive(Debug, thiserror::Error)]
#[error("cannot load the tokenizer from {path}: {message}")]
pub struct LoadTokenizerError {
    pub path: String,
    pub message: String,
}

/// Reads `tokenizer.json` from a Hugging Face model folder.
pub fn load_tokenizer(model_dir: &Path) -> Result<Tokenizer, LoadTokenizerError> {
    let path = model_dir.join("tokenizer.json");
    Tokenizer::from_file(&path).map_err(|error| LoadTokenizerError {
        path: path.display().to_string(),
        message: error.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tokenizer_file_is_a_load_error_naming_it() {
        let error = load_tokenizer(Path::new("/nonexistent/model")).unwrap_err();
        assert_eq!(error.path, "/nonexistent/model/tokenizer.json");
    }
}
