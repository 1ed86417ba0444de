//! The fallback when a replica publishes no KV events: the prefixes of the prompts this router
//! sent it, as a tree of fixed-size chunks (of tokens, or of characters without a tokenizer),
//! bounded in size with least-recently-used eviction.
//!
//! A node is named by the hash of the whole path to it (the chunk and every chunk before it), so
//! the tree is a map from path hash to the time it was last routed, and a prompt's match is its
//! longest run of leading chunks found there. It is approximate: it cannot see what the replica
//! evicted, and a 64-bit path hash may collide.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

pub struct ApproxPrefixTree {
    chunk: usize,
    capacity: usize,
    /// Node -> the tick it was last routed.
    last_used: HashMap<u64, u64>,
    /// Tick -> node, oldest first: the eviction order.
    by_age: BTreeMap<u64, u64>,
    tick: u64,
}

impl ApproxPrefixTree {
    /// A tree of `chunk`-symbol nodes holding at most `capacity` of them.
    pub fn new(chunk: usize, capacity: usize) -> Self {
        assert!(chunk > 0 && capacity > 0);
        ApproxPrefixTree {
            chunk,
            capacity,
            last_used: HashMap::new(),
            by_age: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn chunk(&self) -> usize {
        self.chunk
    }

    pub fn len(&self) -> usize {
        self.last_used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_used.is_empty()
    }

    /// Records that a prompt of these symbols was routed here.
    pub fn insert(&mut self, symbols: &[u32]) {
        // Deepest node first, so that a parent is always younger than its children and eviction
        // takes leaves before the nodes they hang from.
        for node in path_hashes(symbols, self.chunk).into_iter().rev() {
            self.tick += 1;
            if let Some(old) = self.last_used.insert(node, self.tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.tick, node);
        }
        while self.last_used.len() > self.capacity {
            let (_, node) = self.by_age.pop_first().expect("by_age mirrors last_used");
            self.last_used.remove(&node);
        }
        debug_assert_eq!(self.last_used.len(), self.by_age.len());
    }

    /// How many leading chunks of `symbols` were routed here (and not evicted since).
    pub fn matched_chunks(&self, symbols: &[u32]) -> usize {
        path_hashes(symbols, self.chunk)
            .iter()
            .take_while(|node| self.last_used.contains_key(node))
            .count()
    }
}

fn path_hashes(symbols: &[u32], chunk: usize) -> Vec<u64> {
    let mut parent = 0u64;
    symbols
        .chunks_exact(chunk)
        .map(|piece| {
            // DefaultHasher::new() has fixed keys: the same prompt names the same node every time.
            let mut hasher = DefaultHasher::new();
            parent.hash(&mut hasher);
            piece.hash(&mut hasher);
            parent = hasher.finish();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u32, len: u32) -> Vec<u32> {
        (0..len).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn a_routed_prompt_matches_its_full_chunks_and_a_shared_prefix_matches_partly() {
        let mut tree = ApproxPrefixTree::new(4, 100);
        let routed = prompt(1, 10);
        assert_eq!(tree.matched_chunks(&routed), 0);
        tree.insert(&routed);
        assert_eq!(tree.len(), 2, "10 symbols are 2 full chunks of 4");
        assert_eq!(tree.matched_chunks(&routed), 2);
        let mut sibling = routed.clone();
        sibling[6] = 7;
        assert_eq!(tree.matched_chunks(&sibling), 1);
        // The same chunk under another parent is another node.
        let mut shifted = vec![99];
        shifted.extend(&routed);
        assert_eq!(tree.matched_chunks(&shifted), 0);
    }

    #[test]
    fn the_least_recently_routed_leaves_are_evicted_first() {
        let mut tree = ApproxPrefixTree::new(4, 6);
        let (a, b, c) = (prompt(1, 12), prompt(2, 12), prompt(3, 12));
        tree.insert(&a);
        tree.insert(&b);
        // Routing a again makes b the oldest.
        tree.insert(&a);
        tree.insert(&c);
        assert_eq!(tree.len(), 6);
        assert_eq!(tree.matched_chunks(&a), 3);
        assert_eq!(tree.matched_chunks(&c), 3);
        assert_eq!(tree.matched_chunks(&b), 0);
        // Filling one more node takes a's leaf, never a's root before its leaf.
        let d = prompt(4, 4);
        tree.insert(&d);
        assert_eq!(tree.len(), 6);
        assert_eq!(tree.matched_chunks(&a), 2);
        assert_eq!(tree.matched_chunks(&d), 1);
    }
}
