//! `CacheAwarePolicy`: the replica holding the longest prefix of the prompt, unless it is too
//! loaded. A replica whose KV events are followed is matched exactly (the prompt's block hashes
//! against its index); any other replica by the approximate tree of what was routed to it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde_json::Value;

use super::approx_tree::ApproxPrefixTree;
use super::block_hash::{block_hashes, to_hex};
use super::kv_index::KvIndex;
use super::prompt_tokens::PromptTokenizer;
use super::subscriber::{subscribe, Subscription};
use crate::policy::{Candidate, Decision, Policy, ReplicaId, RouteReason, RouteRequest};

/// Chunks of the approximate tree: the engine's default block size in tokens; in characters
/// without a tokenizer (about 16 tokens of English).
const TOKEN_CHUNK: usize = 16;
const CHAR_CHUNK: usize = 64;
/// Nodes per replica's approximate tree: 64k chunks, about a million tokens.
const TREE_CAPACITY: usize = 1 << 16;

#[derive(Debug, Clone)]
pub struct CacheAwareConfig {
    /// The longest match is taken unless its replica's outstanding requests exceed the least
    /// loaded one's by more than `balance_abs` and by more than `balance_rel` times.
    pub balance_abs: usize,
    pub balance_rel: f64,
    /// The served model's folder (tokenizer.json, chat template): needed for exact KV matching.
    pub model_dir: Option<PathBuf>,
}

/// A prompt as the approximate tree keys it.
enum PromptKey {
    Tokens(Vec<u32>),
    /// Unicode scalars of the prompt's text, when there is no tokenizer.
    Chars(Vec<u32>),
}

impl PromptKey {
    fn symbols(&self) -> &[u32] {
        match self {
            PromptKey::Tokens(symbols) | PromptKey::Chars(symbols) => symbols,
        }
    }
}

struct ReplicaState {
    /// Set while KV events are followed (a tokenizer is loaded and a runtime was there to start it).
    subscription: Option<Subscription>,
    tree: ApproxPrefixTree,
}

pub struct CacheAwarePolicy {
    config: CacheAwareConfig,
    tokenizer: Option<PromptTokenizer>,
    replicas: Mutex<HashMap<ReplicaId, ReplicaState>>,
    /// Spreads requests with no match over equally loaded replicas.
    next_tie: AtomicUsize,
}

impl CacheAwarePolicy {
    /// Loads the tokenizer and chat template of `config.model_dir`, if given.
    pub fn new(config: CacheAwareConfig) -> Result<Self, String> {
        if !(config.balance_rel >= 1.0 && config.balance_rel.is_finite()) {
            return Err(format!(
                "--cache-aware-balance-rel must be a number of at least 1, got {}",
                config.balance_rel
            ));
        }
        let tokenizer = match &config.model_dir {
            Some(dir) => Some(
                PromptTokenizer::load(dir)
                    .map_err(|err| format!("cache-aware routing: {}: {err}", dir.display()))?,
            ),
            None => None,
        };
        Ok(CacheAwarePolicy {
            config,
            tokenizer,
            replicas: Mutex::new(HashMap::new()),
            next_tie: AtomicUsize::new(0),
        })
    }

    /// Each replica's block hashes as the router believes them (lower-case hex, sorted):
    /// what `GET /sluice/kv_index` serves. Replicas without KV events list none.
    pub fn index_snapshot(&self) -> BTreeMap<String, Vec<String>> {
        let replicas = self.replicas.lock().expect("never poisoned");
        replicas
            .iter()
            .map(|(id, state)| {
                let mut hashes: Vec<String> = match &state.subscription {
                    Some(subscription) => read(&subscription.index).hashes().map(to_hex).collect(),
                    None => Vec::new(),
                };
                hashes.sort_unstable();
                (id.0.to_string(), hashes)
            })
            .collect()
    }

    fn prompt_key(&self, request: &RouteRequest<'_>) -> Option<PromptKey> {
        match &self.tokenizer {
            Some(tokenizer) => tokenizer
                .prompt_token_ids(request.path, request.body)
                .map(PromptKey::Tokens),
            None => prompt_text(request.path, request.body)
                .map(|text| PromptKey::Chars(text.chars().map(u32::from).collect())),
        }
    }

    fn new_state(&self) -> ReplicaState {
        let chunk = if self.tokenizer.is_some() {
            TOKEN_CHUNK
        } else {
            CHAR_CHUNK
        };
        ReplicaState {
            subscription: None,
            tree: ApproxPrefixTree::new(chunk, TREE_CAPACITY),
        }
    }

    /// The least loaded candidate; ties go round in turn so that idle replicas share new prefixes.
    fn least_loaded(&self, candidates: &[Candidate]) -> usize {
        let min = candidates.iter().map(|c| c.outstanding).min().expect("never empty");
        let tied: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].outstanding == min)
            .collect();
        tied[self.next_tie.fetch_add(1, Ordering::Relaxed) % tied.len()]
    }
}

impl Policy for CacheAwarePolicy {
    fn pick(&self, request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        assert!(!candidates.is_empty(), "pick is never called without candidates");
        let key = self.prompt_key(request);
        let mut replicas = self.replicas.lock().expect("never poisoned");
        for candidate in candidates {
            if !replicas.contains_key(&candidate.id) {
                let state = self.new_state();
                replicas.insert(candidate.id.clone(), state);
            }
        }
        let matches: Vec<usize> = match &key {
            None => vec![0; candidates.len()],
            Some(key) => {
                // Hashes per block size; replicas normally share one, so it is computed once.
                let mut hashes_by_size: HashMap<usize, Vec<_>> = HashMap::new();
                candidates
                    .iter()
                    .map(|c| matched_length(&replicas[&c.id], key, &mut hashes_by_size))
                    .collect()
            }
        };
        let best = (0..candidates.len())
            .max_by_key(|&i| (matches[i], std::cmp::Reverse(candidates[i].outstanding)))
            .expect("never empty");
        let min_outstanding = candidates.iter().map(|c| c.outstanding).min().expect("never empty");
        let outstanding = candidates[best].outstanding;
        let too_loaded = outstanding > min_outstanding + self.config.balance_abs
            && outstanding as f64 > self.config.balance_rel * min_outstanding as f64;
        let (chosen, reason) = if matches[best] == 0 {
            (self.least_loaded(candidates), RouteReason::NoPrefixMatch)
        } else if too_loaded {
            (self.least_loaded(candidates), RouteReason::LoadBound)
        } else {
            (best, RouteReason::PrefixMatch)
        };
        let replica = candidates[chosen].id.clone();
        let prefix_match_tokens = match &key {
            Some(key @ PromptKey::Tokens(_)) => {
                let state = replicas.get_mut(&replica).expect("inserted above");
                state.tree.insert(key.symbols());
                Some(matches[chosen])
            }
            Some(key @ PromptKey::Chars(_)) => {
                replicas.get_mut(&replica).expect("inserted above").tree.insert(key.symbols());
                // A match in characters is no token count.
                None
            }
            None => None,
        };
        Decision {
            replica,
            reason,
            prefix_match_tokens,
        }
    }

    fn replicas_changed(&self, replicas: &[ReplicaId]) {
        let mut known = self.replicas.lock().expect("never poisoned");
        known.retain(|id, _| replicas.contains(id));
        // Exact matching needs the prompt's token ids: without a tokenizer no events are followed.
        let runtime = self
            .tokenizer
            .as_ref()
            .and_then(|_| tokio::runtime::Handle::try_current().ok());
        for id in replicas {
            let state = known.entry(id.clone()).or_insert_with(|| self.new_state());
            if let (None, Some(runtime)) = (&state.subscription, &runtime) {
                state.subscription = Some(subscribe(runtime, &id.0));
            }
        }
    }
}

/// How many prompt tokens (or characters) `state`'s replica is believed to hold.
fn matched_length(
    state: &ReplicaState,
    key: &PromptKey,
    hashes_by_size: &mut HashMap<usize, Vec<super::block_hash::BlockHash>>,
) -> usize {
    if let (PromptKey::Tokens(tokens), Some(subscription)) = (key, &state.subscription) {
        let index = read(&subscription.index);
        if let Some(block_size) = index.block_size() {
            let hashes = hashes_by_size
                .entry(block_size)
                .or_insert_with(|| block_hashes(tokens, block_size));
            // As the engine looks up: the last prompt token is always recomputed.
            let usable = tokens.len().saturating_sub(1) / block_size;
            return index.matched_blocks(&hashes[..usable.min(hashes.len())]) * block_size;
        }
    }
    state.tree.matched_chunks(key.symbols()) * state.tree.chunk()
}

fn read(index: &Arc<RwLock<KvIndex>>) -> std::sync::RwLockReadGuard<'_, KvIndex> {
    index.read().expect("the index lock is never poisoned")
}

/// The prompt's text without a tokenizer: a completion's (first) prompt, token ids written out,
/// or a chat's roles and contents in order.
fn prompt_text(path: &str, body: &Value) -> Option<String> {
    if path.ends_with("/chat/completions") {
        let mut text = String::new();
        for message in body.get("messages")?.as_array()? {
            text.push_str(message.get("role")?.as_str()?);
            text.push('\n');
            match message.get("content") {
                Some(Value::String(content)) => text.push_str(content),
                Some(Value::Array(parts)) => {
                    for part in parts {
                        text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
                    }
                }
                _ => {}
            }
            text.push('\n');
        }
        return Some(text);
    }
    let prompt = body.get("prompt")?;
    let first = match prompt {
        Value::Array(items) if items.first().is_some_and(|v| !v.is_number()) => items.first()?,
        other => other,
    };
    match first {
        Value::String(text) => Some(text.clone()),
        Value::Array(ids) => Some(ids.iter().map(|id| format!("{id} ")).collect()),
        _ => None,
    }
}
