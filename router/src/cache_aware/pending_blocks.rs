//! The blocks a replica is about to hold: the full blocks of prompts routed to it lately, whose
//! KV events have not arrived yet. Without them, requests that share a new prefix and arrive
//! together (before the first one's prefill stores its blocks) see no match anywhere, spread over
//! the replicas, and each replica computes and caches the same prefix.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::block_hash::BlockHash;

pub struct PendingBlocks {
    /// How long a routed block counts as held without the engine confirming it; zero turns the
    /// hint off.
    window: Duration,
    /// When each block was last routed.
    routed_at: HashMap<BlockHash, Instant>,
    /// (time, block) in routing order, to forget old blocks without scanning the map.
    expiry: VecDeque<(Instant, BlockHash)>,
}

impl PendingBlocks {
    pub fn new(window: Duration) -> Self {
        PendingBlocks {
            window,
            routed_at: HashMap::new(),
            expiry: VecDeque::new(),
        }
    }

    /// The prompt's blocks were routed to this replica at `now`.
    pub fn insert(&mut self, hashes: &[BlockHash], now: Instant) {
        if self.window.is_zero() {
            return;
        }
        while let Some(&(routed, hash)) = self.expiry.front() {
            if now.duration_since(routed) < self.window {
                break;
            }
            self.expiry.pop_front();
            if self.routed_at.get(&hash) == Some(&routed) {
                self.routed_at.remove(&hash);
            }
        }
        for hash in hashes {
            self.routed_at.insert(*hash, now);
            self.expiry.push_back((now, *hash));
        }
    }

    /// Whether `hash` was routed here less than the window ago.
    pub fn holds(&self, hash: &BlockHash, now: Instant) -> bool {
        self.routed_at
            .get(hash)
            .is_some_and(|routed| now.duration_since(*routed) < self.window)
    }

    pub fn len(&self) -> usize {
        self.routed_at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.routed_at.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(byte: u8) -> BlockHash {
        [byte; 32]
    }

    #[test]
    fn a_routed_block_is_held_for_the_window_then_forgotten() {
        let start = Instant::now();
        let mut pending = PendingBlocks::new(Duration::from_secs(10));
        pending.insert(&[hash(1), hash(2)], start);
        assert!(pending.holds(&hash(1), start + Duration::from_secs(9)));
        assert!(!pending.holds(&hash(3), start));
        assert!(!pending.holds(&hash(2), start + Duration::from_secs(10)));
        // A later insert drops what has expired, but keeps a block routed again meanwhile.
        pending.insert(&[hash(2)], start + Duration::from_secs(5));
        pending.insert(&[hash(4)], start + Duration::from_secs(11));
        assert!(!pending.holds(&hash(1), start + Duration::from_secs(11)));
        assert!(pending.holds(&hash(2), start + Duration::from_secs(11)));
        assert_eq!(pending.len(), 2);
    }

    #[test]
    fn a_zero_window_holds_nothing() {
        let now = Instant::now();
        let mut pending = PendingBlocks::new(Duration::ZERO);
        pending.insert(&[hash(1)], now);
        assert!(!pending.holds(&hash(1), now));
        assert!(pending.is_empty());
    }
}
