//! `CacheAwarePolicy`: the replica holding the longest prefix of the prompt, unless it is too
//! loaded. A replica whose KV events are followed is matched exactly (the prompt's block hashes
//! against its index); any other replica by the approximate tree of what was routed to it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Candidate, Decision, Policy, ReplicaId, RouteReason, RouteRequest};
use crate::cache_aware::approx_tree::ApproxPrefixTree;
use crate::cache_aware::block_hash::{block_hashes, to_hex, BlockHash};
use crate::cache_aware::kv_index::KvIndex;
use crate::cache_aware::pending_blocks::PendingBlocks;
use crate::cache_aware::prompt_tokens::PromptTokenizer;
use crate::cache_aware::subscriber::{subscribe, Subscription};

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
    /// The key the replicas require (the router's own): their KV-cache snapshots need it too.
    pub api_key: Option<String>,
    /// How long the blocks of a prompt routed to a replica count as held there before its KV
    /// events confirm them (`PendingBlocks`); zero matches on confirmed blocks only.
    pub pending_window: Duration,
}

/// A prompt as the router matches it.
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

/// vLLM's `cache_salt`: the engine shares cached blocks only between requests of equal salts, so
/// a salted prompt is matched by its salted block hashes, and the approximate tree (which knows
/// no salts) neither matches nor learns it.
fn cache_salt<'a>(request: &RouteRequest<'a>) -> Option<&'a str> {
    request.body.get("cache_salt").and_then(Value::as_str)
}

struct ReplicaState {
    /// The exact index, while KV events are followed (a tokenizer is loaded and a runtime was
    /// there to start the subscriber); used only while it is synced.
    index: Option<Arc<RwLock<KvIndex>>>,
    /// Keeps the subscriber task that writes `index` running.
    subscription: Option<Subscription>,
    /// With `index`: the blocks of prompts routed here that the index does not show yet.
    pending: PendingBlocks,
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
                let mut hashes: Vec<String> = match &state.index {
                    Some(index) => read(index).hashes().map(to_hex).collect(),
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
            index: None,
            subscription: None,
            pending: PendingBlocks::new(self.config.pending_window),
            tree: ApproxPrefixTree::new(chunk, TREE_CAPACITY),
        }
    }

    /// The least loaded candidate; ties go round in turn so that idle replicas share new prefixes.
    fn least_loaded(&self, candidates: &[Candidate]) -> usize {
        let min = candidates
            .iter()
            .map(|c| c.outstanding)
            .min()
            .expect("never empty");
        let tied: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].outstanding == min)
            .collect();
        tied[self.next_tie.fetch_add(1, Ordering::Relaxed) % tied.len()]
    }
}

impl Policy for CacheAwarePolicy {
    fn kv_index(&self) -> Option<BTreeMap<String, Vec<String>>> {
        Some(self.index_snapshot())
    }

    fn pick(&self, request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        assert!(
            !candidates.is_empty(),
            "pick is never called without candidates"
        );
        let key = self.prompt_key(request);
        let salt = cache_salt(request);
        let mut replicas = self.replicas.lock().expect("never poisoned");
        for candidate in candidates {
            if !replicas.contains_key(&candidate.id) {
                let state = self.new_state();
                replicas.insert(candidate.id.clone(), state);
            }
        }
        let now = Instant::now();
        // The prompt's block hashes per block size; replicas normally share one, so it is
        // computed once.
        let mut hashes_by_size: HashMap<usize, Vec<BlockHash>> = HashMap::new();
        let matches: Vec<usize> = match &key {
            None => vec![0; candidates.len()],
            Some(key) => candidates
                .iter()
                .map(|c| matched_length(&replicas[&c.id], key, salt, &mut hashes_by_size, now))
                .collect(),
        };
        let best = (0..candidates.len())
            .max_by_key(|&i| (matches[i], std::cmp::Reverse(candidates[i].outstanding)))
            .expect("never empty");
        let min_outstanding = candidates
            .iter()
            .map(|c| c.outstanding)
            .min()
            .expect("never empty");
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
        if let Some(key) = &key {
            let state = replicas.get_mut(&replica).expect("inserted above");
            if salt.is_none() {
                state.tree.insert(key.symbols());
            }
            let block_size = state
                .index
                .as_ref()
                .and_then(|index| read(index).block_size());
            if let Some(hashes) = block_size.and_then(|size| hashes_by_size.get(&size)) {
                state.pending.insert(hashes, now);
            }
        }
        let prefix_match_tokens = match key {
            Some(PromptKey::Tokens(_)) => Some(matches[chosen]),
            // A match in characters is no token count.
            Some(PromptKey::Chars(_)) | None => None,
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
                let subscription = subscribe(runtime, &id.0, self.config.api_key.as_deref());
                state.index = Some(subscription.index.clone());
                state.subscription = Some(subscription);
            }
        }
    }
}

/// How many prompt tokens (or characters) `state`'s replica is believed to hold.
fn matched_length(
    state: &ReplicaState,
    key: &PromptKey,
    salt: Option<&str>,
    hashes_by_size: &mut HashMap<usize, Vec<BlockHash>>,
    now: Instant,
) -> usize {
    if let (PromptKey::Tokens(tokens), Some(index)) = (key, &state.index) {
        let index = read(index);
        if let Some(block_size) = index.block_size() {
            let hashes = hashes_by_size
                .entry(block_size)
                .or_insert_with(|| block_hashes(tokens, block_size, salt));
            // As the engine looks up: the last prompt token is always recomputed.
            let usable = tokens.len().saturating_sub(1) / block_size;
            let held = hashes[..usable.min(hashes.len())]
                .iter()
                .take_while(|hash| index.holds(hash) || state.pending.holds(hash, now))
                .count();
            return held * block_size;
        }
    }
    if salt.is_some() {
        return 0;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_aware::kv_index::Snapshot;
    use serde_json::json;
    use sluice_common::text::default_model::default_model_dir as model_dir;

    fn policy(model: bool) -> CacheAwarePolicy {
        policy_with_pending(model, Duration::ZERO)
    }

    fn policy_with_pending(model: bool, pending_window: Duration) -> CacheAwarePolicy {
        CacheAwarePolicy::new(CacheAwareConfig {
            balance_abs: 8,
            balance_rel: 1.5,
            model_dir: model.then(model_dir),
            api_key: None,
            pending_window,
        })
        .unwrap()
    }

    fn id(name: &str) -> ReplicaId {
        ReplicaId(Arc::from(name))
    }

    fn candidates(loads: &[usize]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &outstanding)| Candidate {
                id: id(&format!("http://r{i}:8000")),
                outstanding,
            })
            .collect()
    }

    fn tokens(seed: u32, len: u32) -> Vec<u32> {
        (0..len).map(|i| 100 + seed * 1000 + i).collect()
    }

    fn completion(ids: &[u32]) -> Value {
        json!({"model": "m", "prompt": ids})
    }

    fn pick(policy: &CacheAwarePolicy, body: &Value, loads: &[usize]) -> Decision {
        let request = RouteRequest {
            path: "/v1/completions",
            body,
            session_key: None,
        };
        policy.pick(&request, &candidates(loads))
    }

    /// Gives replica `i` a synced index holding `hashes`, as its subscriber would.
    fn hold(policy: &CacheAwarePolicy, i: usize, hashes: &[BlockHash]) {
        let mut index = KvIndex::default();
        index
            .reset(&Snapshot {
                seq: 1,
                block_size: 16,
                kv_events_port: Some(1),
                block_hashes: hashes.iter().map(to_hex).collect(),
            })
            .unwrap();
        let mut state = policy.new_state();
        state.index = Some(Arc::new(RwLock::new(index)));
        let name = format!("http://r{i}:8000");
        policy.replicas.lock().unwrap().insert(id(&name), state);
    }

    #[test]
    fn the_longest_exact_match_wins_within_the_load_bound() {
        let policy = policy(true);
        let prompt = tokens(1, 64);
        let hashes = block_hashes(&prompt, 16, None);
        hold(&policy, 0, &hashes[..1]);
        hold(&policy, 1, &hashes);
        hold(&policy, 2, &[]);
        let decision = pick(&policy, &completion(&prompt), &[0, 3, 0]);
        assert_eq!(decision.replica, id("http://r1:8000"));
        assert_eq!(decision.reason, RouteReason::PrefixMatch);
        // 64 tokens: the engine recomputes the last one, so 3 blocks of 16 can be hits.
        assert_eq!(decision.prefix_match_tokens, Some(48));
        // At the bound (8 more than the least loaded) it still wins.
        assert_eq!(
            pick(&policy, &completion(&prompt), &[0, 8, 0]).replica,
            id("http://r1:8000")
        );
        // Past both bounds the least loaded replica takes it.
        let bounded = pick(&policy, &completion(&prompt), &[1, 10, 4]);
        assert_eq!(bounded.reason, RouteReason::LoadBound);
        assert_eq!(bounded.replica, id("http://r0:8000"));
        // Past the absolute bound but within 1.5x of the least loaded: still the match.
        let relative = pick(&policy, &completion(&prompt), &[20, 29, 25]);
        assert_eq!(relative.replica, id("http://r1:8000"));
        assert_eq!(relative.reason, RouteReason::PrefixMatch);
    }

    #[test]
    fn a_salted_prompt_matches_only_blocks_of_its_own_salt() {
        let policy = policy(true);
        let prompt = tokens(1, 64);
        hold(&policy, 0, &block_hashes(&prompt, 16, None));
        hold(&policy, 1, &block_hashes(&prompt, 16, Some("tenant-a")));
        let salted = |salt: &str| json!({"model": "m", "prompt": prompt, "cache_salt": salt});
        let own = pick(&policy, &salted("tenant-a"), &[0, 0]);
        assert_eq!(own.replica, id("http://r1:8000"));
        assert_eq!(own.prefix_match_tokens, Some(48));
        // Another salt's blocks, or the unsalted ones, are no match to the engine either.
        let other = pick(&policy, &salted("tenant-b"), &[0, 0]);
        assert_eq!(other.reason, RouteReason::NoPrefixMatch);
        assert_eq!(other.prefix_match_tokens, Some(0));
        assert_eq!(
            pick(&policy, &completion(&prompt), &[0, 0]).replica,
            id("http://r0:8000")
        );
    }

    #[test]
    fn a_new_prefix_routed_twice_before_its_events_arrive_stays_on_one_replica() {
        let prompt = tokens(7, 64);
        let pending = policy_with_pending(true, Duration::from_secs(10));
        hold(&pending, 0, &[]);
        hold(&pending, 1, &[]);
        let first = pick(&pending, &completion(&prompt), &[0, 0]);
        assert_eq!(first.reason, RouteReason::NoPrefixMatch);
        let second = pick(&pending, &completion(&prompt), &[0, 0]);
        assert_eq!(second.replica, first.replica);
        assert_eq!(second.reason, RouteReason::PrefixMatch);
        assert_eq!(second.prefix_match_tokens, Some(48));
        // Confirmed blocks only (the hint off): idle replicas take the unknown prefix in turn.
        let confirmed_only = policy(true);
        hold(&confirmed_only, 0, &[]);
        hold(&confirmed_only, 1, &[]);
        let first = pick(&confirmed_only, &completion(&prompt), &[0, 0]);
        let second = pick(&confirmed_only, &completion(&prompt), &[0, 0]);
        assert_ne!(second.replica, first.replica);
        assert_eq!(second.reason, RouteReason::NoPrefixMatch);
    }

    #[test]
    fn without_a_match_the_least_loaded_replicas_take_turns() {
        let policy = policy(true);
        for i in 0..3 {
            hold(&policy, i, &[]);
        }
        let mut chosen = std::collections::HashSet::new();
        for seed in 0..4 {
            let decision = pick(&policy, &completion(&tokens(seed, 40)), &[2, 0, 0]);
            assert_eq!(decision.reason, RouteReason::NoPrefixMatch);
            assert_eq!(decision.prefix_match_tokens, Some(0));
            assert_ne!(decision.replica, id("http://r0:8000"));
            chosen.insert(decision.replica);
        }
        assert_eq!(chosen.len(), 2, "idle replicas share new prefixes");
    }

    #[test]
    fn a_replica_without_events_is_matched_by_the_approximate_tree() {
        let policy = policy(true);
        let prompt = tokens(7, 100);
        // Neither replica has a synced index: the first request lands somewhere...
        let first = pick(&policy, &completion(&prompt), &[0, 0]);
        assert_eq!(first.reason, RouteReason::NoPrefixMatch);
        // ...and a request sharing its first 64 tokens follows it, matched in 16-token chunks.
        let mut sibling = prompt[..64].to_vec();
        sibling.extend(tokens(8, 30));
        let second = pick(&policy, &completion(&sibling), &[0, 0]);
        assert_eq!(second.replica, first.replica);
        assert_eq!(second.reason, RouteReason::PrefixMatch);
        assert_eq!(second.prefix_match_tokens, Some(64));
    }

    #[test]
    fn without_a_tokenizer_text_prefixes_are_matched_in_characters() {
        let policy = policy(false);
        let shared = "You are a helpful assistant. ".repeat(10);
        let chat = |question: &str| {
            json!({"model": "m", "messages": [
                {"role": "system", "content": shared},
                {"role": "user", "content": question},
            ]})
        };
        let request = |body: &Value| -> Decision {
            let request = RouteRequest {
                path: "/v1/chat/completions",
                body,
                session_key: None,
            };
            policy.pick(&request, &candidates(&[0, 0, 0]))
        };
        let first = request(&chat("What is 2 + 2?"));
        assert_eq!(first.reason, RouteReason::NoPrefixMatch);
        for question in ["Name a colour.", "Why is the sky blue?"] {
            let next = request(&chat(question));
            assert_eq!(next.replica, first.replica);
            assert_eq!(next.reason, RouteReason::PrefixMatch);
            assert_eq!(next.prefix_match_tokens, None);
        }
        assert!(policy.index_snapshot().values().all(Vec::is_empty));
    }

    #[test]
    fn a_bad_body_is_routed_to_the_least_loaded_replica() {
        let policy = policy(true);
        let decision = pick(&policy, &json!({"prompt": {"not": "a prompt"}}), &[3, 1]);
        assert_eq!(decision.replica, id("http://r1:8000"));
        assert_eq!(decision.reason, RouteReason::NoPrefixMatch);
        assert_eq!(decision.prefix_match_tokens, None);
    }

    #[test]
    fn the_index_snapshot_lists_each_replica_in_hex() {
        let policy = policy(true);
        let hashes = block_hashes(&tokens(1, 32), 16, None);
        hold(&policy, 0, &hashes);
        hold(&policy, 1, &[]);
        let mut expected: Vec<String> = hashes.iter().map(to_hex).collect();
        expected.sort();
        let snapshot = policy.index_snapshot();
        assert_eq!(snapshot["http://r0:8000"], expected);
        assert!(snapshot["http://r1:8000"].is_empty());
    }

    #[test]
    fn a_bad_balance_is_refused() {
        let config = CacheAwareConfig {
            balance_abs: 8,
            balance_rel: 0.5,
            model_dir: None,
            api_key: None,
            pending_window: Duration::ZERO,
        };
        assert!(CacheAwarePolicy::new(config).is_err());
        let missing = CacheAwareConfig {
            balance_abs: 8,
            balance_rel: 1.5,
            model_dir: Some(PathBuf::from("/nonexistent/model")),
            api_key: None,
            pending_window: Duration::ZERO,
        };
        assert!(CacheAwarePolicy::new(missing).is_err());
    }
}
