//! One replica's prefix cache as the router believes it: the block hashes its engine core holds,
//! kept from a snapshot plus the KV events after it. The subscriber writes it; the policy reads it.

use std::collections::HashSet;

use super::block_hash::{from_hex, BlockHash};
use super::kv_events::{KvEvent, KvEvents};

/// What `GET /sluice/kv_cache` answers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Snapshot {
    pub seq: u64,
    pub block_size: u32,
    pub kv_events_port: Option<u16>,
    pub block_hashes: Vec<String>,
}

/// What applying one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Applied,
    /// Not applied: the snapshot already covers it (seq not above it), or the index is waiting
    /// for a snapshot.
    Skipped,
    /// Messages were lost: the index no longer follows the replica until it is reset.
    Gap {
        expected: u64,
        got: u64,
    },
}

#[derive(Debug, Default)]
pub struct KvIndex {
    hashes: HashSet<BlockHash>,
    /// The seq of the last message applied (or the snapshot's).
    seq: u64,
    block_size: usize,
    /// True from a snapshot until a gap or a lost connection: only then is the index trusted.
    synced: bool,
}

impl KvIndex {
    /// Starts over from `snapshot`; an error (a hash that is not 64 hex digits, a zero block
    /// size) leaves the index unsynced.
    pub fn reset(&mut self, snapshot: &Snapshot) -> Result<(), String> {
        self.synced = false;
        if snapshot.block_size == 0 {
            return Err("the snapshot's block_size is 0".into());
        }
        let hashes = snapshot
            .block_hashes
            .iter()
            .map(|hex| from_hex(hex).ok_or_else(|| format!("{hex:?} is not a block hash")))
            .collect::<Result<HashSet<_>, _>>()?;
        self.hashes = hashes;
        self.seq = snapshot.seq;
        self.block_size = snapshot.block_size as usize;
        self.synced = true;
        Ok(())
    }

    /// Applies `message` if it is the next one; a gap unsyncs the index.
    pub fn apply(&mut self, message: &KvEvents) -> Applied {
        if !self.synced {
            return Applied::Skipped;
        }
        if message.seq <= self.seq {
            return Applied::Skipped;
        }
        if message.seq != self.seq + 1 {
            self.synced = false;
            return Applied::Gap {
                expected: self.seq + 1,
                got: message.seq,
            };
        }
        for event in &message.events {
            match event {
                KvEvent::BlockStored { block_hash, .. } => {
                    self.hashes.insert(**block_hash);
                }
                KvEvent::BlockRemoved { block_hash } => {
                    self.hashes.remove(&**block_hash);
                }
                KvEvent::AllCleared => self.hashes.clear(),
            }
        }
        self.seq = message.seq;
        Applied::Applied
    }

    /// The connection was lost: the replica may have changed unseen.
    pub fn unsync(&mut self) {
        self.synced = false;
    }

    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// The block size hashes must be computed with for this replica (known once synced).
    pub fn block_size(&self) -> Option<usize> {
        self.synced.then_some(self.block_size)
    }

    /// How many of `prompt_hashes`' leading blocks the replica holds.
    pub fn holds(&self, hash: &BlockHash) -> bool {
        self.hashes.contains(hash)
    }

    pub fn hashes(&self) -> impl Iterator<Item = &BlockHash> {
        self.hashes.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_aware::block_hash::{block_hashes, to_hex};

    /// How many leading blocks of a prompt the index holds, as the policy counts them.
    fn matched_blocks(index: &KvIndex, prompt_hashes: &[BlockHash]) -> usize {
        prompt_hashes
            .iter()
            .take_while(|hash| index.holds(hash))
            .count()
    }

    fn snapshot(seq: u64, hashes: &[BlockHash]) -> Snapshot {
        Snapshot {
            seq,
            block_size: 16,
            kv_events_port: Some(5557),
            block_hashes: hashes.iter().map(to_hex).collect(),
        }
    }

    fn prompt() -> Vec<BlockHash> {
        block_hashes(&(0..64).collect::<Vec<u32>>(), 16, None)
    }

    #[test]
    fn events_after_the_snapshot_apply_in_order_and_earlier_ones_are_skipped() {
        let h = prompt();
        let mut index = KvIndex::default();
        assert_eq!(index.block_size(), None);
        index.reset(&snapshot(5, &h[..1])).unwrap();
        assert_eq!(index.block_size(), Some(16));
        // A message the snapshot already covers (buffered while it was read) changes nothing.
        let stale = KvEvents {
            seq: 5,
            events: vec![KvEvent::removed(h[0])],
        };
        assert_eq!(index.apply(&stale), Applied::Skipped);
        assert_eq!(matched_blocks(&index, &h), 1);
        let next = KvEvents {
            seq: 6,
            events: vec![
                KvEvent::stored(h[1], Some(h[0])),
                KvEvent::stored(h[2], Some(h[1])),
            ],
        };
        assert_eq!(index.apply(&next), Applied::Applied);
        assert_eq!(matched_blocks(&index, &h), 3);
        let evict = KvEvents {
            seq: 7,
            events: vec![KvEvent::removed(h[1])],
        };
        assert_eq!(index.apply(&evict), Applied::Applied);
        // A hole in the chain ends the match, even though block 2 is still held.
        assert_eq!(matched_blocks(&index, &h), 1);
        let cleared = KvEvents {
            seq: 8,
            events: vec![KvEvent::AllCleared, KvEvent::stored(h[0], None)],
        };
        assert_eq!(index.apply(&cleared), Applied::Applied);
        let held: Vec<_> = index.hashes().copied().collect();
        assert_eq!(held, vec![h[0]]);
    }

    #[test]
    fn a_gap_unsyncs_until_the_next_snapshot() {
        let h = prompt();
        let mut index = KvIndex::default();
        index.reset(&snapshot(1, &[])).unwrap();
        let skipped = KvEvents {
            seq: 3,
            events: vec![KvEvent::stored(h[0], None)],
        };
        assert_eq!(
            index.apply(&skipped),
            Applied::Gap {
                expected: 2,
                got: 3
            }
        );
        assert!(!index.is_synced());
        assert_eq!(index.block_size(), None);
        // Nothing applies while unsynced, not even the next seq.
        let next = KvEvents {
            seq: 4,
            events: vec![KvEvent::stored(h[1], Some(h[0]))],
        };
        assert_eq!(index.apply(&next), Applied::Skipped);
        // Resync: the snapshot taken after seq 3 holds h[0]; seq 4 then applies on top.
        index.reset(&snapshot(3, &h[..1])).unwrap();
        assert_eq!(index.apply(&next), Applied::Applied);
        assert_eq!(matched_blocks(&index, &h), 2);
    }

    #[test]
    fn a_bad_snapshot_is_refused() {
        let mut index = KvIndex::default();
        let mut bad = snapshot(1, &[]);
        bad.block_hashes.push("xyz".into());
        assert!(index.reset(&bad).is_err());
        assert!(!index.is_synced());
        let mut zero = snapshot(1, &[]);
        zero.block_size = 0;
        assert!(index.reset(&zero).is_err());
    }
}
