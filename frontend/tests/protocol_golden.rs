//! The golden vectors in `tests/golden/protocol/`, shared with the Python
//! tests: each file decodes to the value `index.json` records for it, and
//! re-encodes to exactly its bytes.

use std::path::PathBuf;

use serde_json::Value;
use sluice_frontend::engine::protocol::{decode, encode, Message, PROTOCOL_VERSION};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/protocol")
}

fn index() -> Value {
    let path = golden_dir().join("index.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
    serde_json::from_str(&text).expect("index.json is JSON")
}

/// The message as index.json writes it: JSON has no bytes, so a bin (an output's embedding) is
/// lower-case hex there.
fn as_indexed(message: &Message) -> Value {
    let mut value = serde_json::to_value(message).unwrap();
    let outputs = value.get_mut("outputs").and_then(Value::as_array_mut);
    for output in outputs.into_iter().flatten() {
        if let Some(Value::Array(bytes)) = output.get("embedding") {
            let hex: String = bytes
                .iter()
                .map(|byte| format!("{:02x}", byte.as_u64().expect("a byte")))
                .collect();
            output["embedding"] = Value::String(hex);
        }
    }
    value
}

#[test]
fn golden_vectors_decode_to_their_values_and_reencode_to_their_bytes() {
    let index = index();
    assert_eq!(index["protocol_version"], PROTOCOL_VERSION);
    let vectors = index["vectors"].as_array().expect("a list of vectors");
    assert!(!vectors.is_empty());
    for vector in vectors {
        let file = vector["file"].as_str().expect("file name");
        let bytes = std::fs::read(golden_dir().join(file)).expect(file);
        let message = decode(&bytes).unwrap_or_else(|err| panic!("{file}: {err}"));
        assert_eq!(message.type_name(), vector["type"], "{file}");
        assert_eq!(
            as_indexed(&message),
            vector["value"],
            "{file}: decoded value differs"
        );
        assert_eq!(encode(&message), bytes, "{file}: re-encoded bytes differ");
    }
}

#[test]
fn every_message_type_has_a_golden_vector() {
    let index = index();
    let mut types: Vec<&str> = index["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["type"].as_str().unwrap())
        .collect();
    types.sort_unstable();
    types.dedup();
    assert_eq!(
        types,
        [
            "abort",
            "add_request",
            "outputs",
            "ready",
            "utility",
            "utility_result"
        ]
    );
}
