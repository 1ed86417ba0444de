//! Cache-aware routing: the replica most likely to hold a prompt's prefix, within a load bound.
//!
//! Each replica's engine core publishes its prefix cache's changes (KV events, `kv_events`); a
//! `subscriber` task per replica keeps a `kv_index` of the block hashes it holds. The policy
//! tokenizes a prompt as the frontend does (`prompt_tokens`), hashes its full blocks as the engine
//! does (`block_hash`) and looks them up; a replica without events is matched by the
//! `approx_tree` of the prompts routed to it.

pub mod approx_tree;
pub mod block_hash;
pub mod kv_events;
pub mod kv_index;
pub mod pending_blocks;
pub mod policy;
pub mod prompt_tokens;
pub mod subscriber;

pub use policy::{CacheAwareConfig, CacheAwarePolicy};

/// The default model's folder for unit tests, found as the frontend's tests find it.
#[cfg(test)]
pub(crate) fn test_model_dir() -> std::path::PathBuf {
    use std::path::PathBuf;
    const NAME: &str = "SmolLM2-135M-Instruct";
    if let Some(dir) = std::env::var_os("SLUICE_MODEL_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(cache) = std::env::var_os("SLUICE_CACHE") {
        return PathBuf::from(cache).join("models").join(NAME);
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    PathBuf::from(home).join(".cache/sluice/models").join(NAME)
}
