//! The engine core's chained block hash (`python/engine/block_pool.py` `hash_block_tokens`):
//! sha256 over the parent block's digest, then the block's token ids as little-endian int64. The
//! first block's parent is nothing, or with vLLM's `cache_salt` the digest of `cache_salt:` and
//! the salt (`cache_salt_root`). Equal hashes name equal prefixes (under equal salts), so a router
//! that hashes a prompt this way can look its blocks up in a replica's prefix cache.

use sha2::{Digest, Sha256};

pub type BlockHash = [u8; 32];

/// The hash of each full block of `token_ids`, in order; a partial last block is not hashed.
pub fn block_hashes(
    token_ids: &[u32],
    block_size: usize,
    cache_salt: Option<&str>,
) -> Vec<BlockHash> {
    assert!(block_size > 0, "a block holds at least one token");
    let root: Option<BlockHash> = cache_salt.map(|salt| {
        let mut digest = Sha256::new();
        digest.update(b"cache_salt:");
        digest.update(salt.as_bytes());
        digest.finalize().into()
    });
    let mut hashes: Vec<BlockHash> = Vec::with_capacity(token_ids.len() / block_size);
    for block in token_ids.chunks_exact(block_size) {
        let mut digest = Sha256::new();
        if let Some(parent) = hashes.last().or(root.as_ref()) {
            digest.update(parent);
        }
        for &token in block {
            // Widened as unsigned: an id is never negative, and u32 -> i64 keeps its value.
            digest.update(i64::from(token).to_le_bytes());
        }
        hashes.push(digest.finalize().into());
    }
    hashes
}

pub fn to_hex(hash: &BlockHash) -> String {
    hash.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// A 64-digit hex string (as `GET /sluice/kv_cache` lists hashes) as a hash; None if it is not one.
pub fn from_hex(text: &str) -> Option<BlockHash> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut hash = [0u8; 32];
    for (byte, pair) in hash.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn golden() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/golden/kv_events/block_hashes.json"
        );
        let text = std::fs::read_to_string(path).expect("the block-hash golden vector");
        serde_json::from_str(&text).expect("JSON")
    }

    #[test]
    fn hashes_match_the_independent_golden_vector() {
        let vector = golden();
        let block_size = vector["block_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = vector["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| u32::try_from(id.as_u64().unwrap()).unwrap())
            .collect();
        assert_eq!(block_size, 16);
        assert_ne!(
            tokens.len() % block_size,
            0,
            "the vector ends with a partial block"
        );
        let salt = vector["cache_salt"].as_str().unwrap();
        for (salt, key) in [(None, "block_hashes"), (Some(salt), "salted_block_hashes")] {
            let expected: Vec<&str> = vector[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_str().unwrap())
                .collect();
            let got: Vec<String> = block_hashes(&tokens, block_size, salt)
                .iter()
                .map(to_hex)
                .collect();
            assert_eq!(got, expected, "{key}");
        }
    }

    #[test]
    fn a_prefix_has_the_same_leading_hashes() {
        let tokens: Vec<u32> = (0..100).collect();
        let all = block_hashes(&tokens, 16, None);
        assert_eq!(all.len(), 6);
        assert_eq!(block_hashes(&tokens[..40], 16, None), all[..2]);
        let mut changed = tokens.clone();
        changed[17] = 9999;
        let other = block_hashes(&changed, 16, None);
        assert_eq!(other[0], all[0]);
        // The change in block 1 changes every later hash through the chain.
        assert!(other[1..].iter().zip(&all[1..]).all(|(a, b)| a != b));
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let hash = block_hashes(&[1; 16], 16, None)[0];
        assert_eq!(from_hex(&to_hex(&hash)), Some(hash));
        assert_eq!(from_hex("00"), None);
        assert_eq!(from_hex(&"zz".repeat(32)), None);
        assert_eq!(from_hex(&"é".repeat(32)), None);
    }
}
