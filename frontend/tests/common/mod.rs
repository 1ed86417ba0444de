//! What the integration tests of this folder share.

use std::path::PathBuf;

/// The default model's folder: SLUICE_MODEL_DIR, else where `sluice model prepare` puts it.
pub fn model_dir() -> PathBuf {
    std::env::var_os("SLUICE_MODEL_DIR").map_or_else(
        || {
            let home = std::env::var_os("HOME").expect("HOME is set");
            PathBuf::from(home).join(".cache/sluice/models/SmolLM2-135M-Instruct")
        },
        PathBuf::from,
    )
}
