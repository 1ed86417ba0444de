//! What cache-aware routing (`policies::CacheAwarePolicy`) knows of the replicas' prefix caches.
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
pub mod prompt_tokens;
pub mod subscriber;
