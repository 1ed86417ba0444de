//! The default model's folder and tokenizer, as the tests of the frontend and of the router find them.

use std::path::PathBuf;

/// The default model's folder: `$SLUICE_MODEL_DIR`, else
/// `$SLUICE_CACHE/models/SmolLM2-135M-Instruct`, else `~/.cache/sluice/models/...` (where
/// `sluice model prepare` puts it).
pub fn default_model_dir() -> PathBuf {
    const MODEL: &str = "SmolLM2-135M-Instruct";
    if let Some(dir) = std::env::var_os("SLUICE_MODEL_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(cache) = std::env::var_os("SLUICE_CACHE") {
        return PathBuf::from(cache).join("models").join(MODEL);
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    PathBuf::from(home).join(".cache/sluice/models").join(MODEL)
}

/// The default model's tokenizer, for tests; panics when it cannot be loaded.
pub fn load_default_model_tokenizer() -> tokenizers::Tokenizer {
    let path = default_model_dir().join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path).unwrap_or_else(|error| {
        panic!(
            "cannot load {}: {error} (set SLUICE_MODEL_DIR to the default model's folder)",
            path.display()
        )
    })
}
