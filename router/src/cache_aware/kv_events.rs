//! The engine core → router seam (`docs/protocol.md`, "The engine core → router seam (KV
//! events)"): the Rust half of `python/sluice/kv_events_seam.py`. One `kv_events` message is one
//! engine step's changes to a replica's prefix cache, numbered by `seq`.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteArray;

use super::block_hash::BlockHash;

/// The only protocol version this build speaks.
pub const PROTOCOL_VERSION: u64 = 1;
const MESSAGE_TYPE: &str = "kv_events";

/// One change to a prefix cache. Encoded as a map whose first key is `type`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    BlockStored {
        block_hash: ByteArray<32>,
        /// None for a prompt's first block.
        parent_hash: Option<ByteArray<32>>,
    },
    BlockRemoved {
        block_hash: ByteArray<32>,
    },
    AllCleared,
}

impl KvEvent {
    pub fn stored(block_hash: BlockHash, parent_hash: Option<BlockHash>) -> Self {
        KvEvent::BlockStored {
            block_hash: ByteArray::new(block_hash),
            parent_hash: parent_hash.map(ByteArray::new),
        }
    }

    pub fn removed(block_hash: BlockHash) -> Self {
        KvEvent::BlockRemoved {
            block_hash: ByteArray::new(block_hash),
        }
    }
}

/// One message: the changes of one engine step, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvents {
    /// 1, 2, 3... per engine core: a gap means messages were lost.
    pub seq: u64,
    pub events: Vec<KvEvent>,
}

/// The wire form: `v` and `type` ahead of the fields, as on the other seams.
#[derive(Serialize, Deserialize)]
struct Wire {
    v: u64,
    #[serde(rename = "type")]
    kind: String,
    seq: u64,
    events: Vec<KvEvent>,
}

/// The canonical msgpack body of `message`.
pub fn encode(message: &KvEvents) -> Vec<u8> {
    let wire = Wire {
        v: PROTOCOL_VERSION,
        kind: MESSAGE_TYPE.into(),
        seq: message.seq,
        events: message.events.clone(),
    };
    rmp_serde::to_vec_named(&wire).expect("kv_events messages always encode")
}

/// Parses one message; never panics, whatever the bytes.
pub fn decode(bytes: &[u8]) -> Result<KvEvents, String> {
    // rmp-serde would also accept a struct encoded as an array; the spec allows only maps.
    if !matches!(bytes.first(), Some(0x80..=0x8f | 0xde | 0xdf)) {
        return Err("a message is a msgpack map".into());
    }
    let wire: Wire = rmp_serde::from_slice(bytes).map_err(|err| err.to_string())?;
    if wire.v != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", wire.v));
    }
    if wire.kind != MESSAGE_TYPE {
        return Err(format!("unknown message type {:?}", wire.kind));
    }
    if wire.seq == 0 {
        return Err("seq starts at 1".into());
    }
    Ok(KvEvents {
        seq: wire.seq,
        events: wire.events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_aware::block_hash::to_hex;
    use serde_json::{json, Value};
    use std::path::PathBuf;

    fn golden_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/kv_events")
    }

    /// The message as index.json writes it: the msgpack body as JSON, bins as hex strings.
    fn as_json(message: &KvEvents) -> Value {
        let events: Vec<Value> = message
            .events
            .iter()
            .map(|event| match event {
                KvEvent::BlockStored {
                    block_hash,
                    parent_hash,
                } => json!({
                    "type": "block_stored",
                    "block_hash": to_hex(block_hash),
                    "parent_hash": parent_hash.as_ref().map(|h| to_hex(h)),
                }),
                KvEvent::BlockRemoved { block_hash } => {
                    json!({"type": "block_removed", "block_hash": to_hex(block_hash)})
                }
                KvEvent::AllCleared => json!({"type": "all_cleared"}),
            })
            .collect();
        json!({"v": 1, "type": "kv_events", "seq": message.seq, "events": events})
    }

    #[test]
    fn golden_vectors_decode_to_their_values_and_reencode_to_their_bytes() {
        let text = std::fs::read_to_string(golden_dir().join("index.json")).unwrap();
        let index: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(index["protocol_version"], PROTOCOL_VERSION);
        let vectors = index["vectors"].as_array().unwrap();
        assert!(vectors.len() >= 3);
        let mut kinds = std::collections::HashSet::new();
        for vector in vectors {
            let file = vector["file"].as_str().unwrap();
            let bytes = std::fs::read(golden_dir().join(file)).unwrap();
            let message = decode(&bytes).unwrap_or_else(|err| panic!("{file}: {err}"));
            assert_eq!(as_json(&message), vector["value"], "{file}");
            assert_eq!(encode(&message), bytes, "{file}: re-encoded bytes differ");
            for event in &message.events {
                kinds.insert(std::mem::discriminant(event));
            }
        }
        assert_eq!(kinds.len(), 3, "every event type has a golden vector");
    }

    #[test]
    fn bad_messages_are_errors() {
        let good = encode(&KvEvents {
            seq: 1,
            events: vec![KvEvent::removed([7; 32])],
        });
        assert!(decode(&good).is_ok());
        // The hash is the last 34 bytes: bin8 (0xc4), length 32, the digest. Make it 31 long.
        let at = good.len() - 34;
        assert_eq!(good[at..at + 2], [0xc4, 0x20]);
        let mut short_hash = good[..at].to_vec();
        short_hash.extend([0xc4, 0x1f]);
        short_hash.extend([7; 31]);
        assert!(decode(&short_hash).is_err());
        let unknown_event = rmp_serde::to_vec_named(&json!({
            "v": 1, "type": "kv_events", "seq": 1, "events": [{"type": "block_moved"}],
        }))
        .unwrap();
        assert!(decode(&unknown_event).is_err());
        let seq_zero = rmp_serde::to_vec_named(&json!({
            "v": 1, "type": "kv_events", "seq": 0, "events": [],
        }))
        .unwrap();
        assert!(decode(&seq_zero).is_err());
        let v2 = rmp_serde::to_vec_named(&json!({
            "v": 2, "type": "kv_events", "seq": 1, "events": [],
        }))
        .unwrap();
        assert!(decode(&v2).is_err());
        assert!(decode(&[]).is_err());
        assert!(decode(&[0x91, 0x01]).is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let bytes = encode(&KvEvents {
            seq: 300,
            events: vec![
                KvEvent::stored([1; 32], None),
                KvEvent::stored([2; 32], Some([1; 32])),
                KvEvent::removed([1; 32]),
                KvEvent::AllCleared,
            ],
        });
        for end in 0..bytes.len() {
            assert!(decode(&bytes[..end]).is_err());
        }
        for at in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut mutated = bytes.clone();
                mutated[at] ^= flip;
                let _ = decode(&mutated);
            }
        }
    }
}
