//! The KV-events subscriber against a fake replica over real HTTP and real ZeroMQ: a fake engine
//! keeps a set of block hashes, serves it as `GET /sluice/kv_cache` and publishes each change as
//! a numbered `kv_events` message; the router's index must end equal to the engine's set, also
//! after messages were lost (a gap, then a resync from the snapshot).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use sluice_router::cache_aware::block_hash::{block_hashes, to_hex, BlockHash};
use sluice_router::cache_aware::kv_events::{encode, KvEvent, KvEvents};
use sluice_router::policies::{CacheAwareConfig, CacheAwarePolicy};
use sluice_router::policies::{Policy, ReplicaId};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

#[derive(Default)]
struct EngineState {
    seq: u64,
    hashes: BTreeSet<String>,
}

struct FakeEngine {
    state: Arc<Mutex<EngineState>>,
    publisher: PubSocket,
}

impl FakeEngine {
    /// Applies `events` as the engine would, then sends them unless the message is to be lost.
    async fn step(&mut self, events: Vec<KvEvent>, lost: bool) {
        let seq = {
            let mut state = self.state.lock().unwrap();
            for event in &events {
                match event {
                    KvEvent::BlockStored { block_hash, .. } => {
                        state.hashes.insert(to_hex(block_hash));
                    }
                    KvEvent::BlockRemoved { block_hash } => {
                        state.hashes.remove(&to_hex(block_hash));
                    }
                    KvEvent::AllCleared => state.hashes.clear(),
                }
            }
            state.seq += 1;
            state.seq
        };
        if !lost {
            let body = encode(&KvEvents { seq, events });
            self.publisher.send(ZmqMessage::from(body)).await.unwrap();
        }
    }

    fn hashes(&self) -> Vec<String> {
        self.state.lock().unwrap().hashes.iter().cloned().collect()
    }
}

/// The replica's API key: like a real one started with --api-key, it answers only with it.
const API_KEY: &str = "replica-key";

async fn snapshot(
    State(state): State<(Arc<Mutex<EngineState>>, u16)>,
    headers: axum::http::HeaderMap,
) -> Result<Json<Value>, axum::http::StatusCode> {
    let authorization = headers.get(axum::http::header::AUTHORIZATION);
    if authorization.and_then(|value| value.to_str().ok()) != Some(&format!("Bearer {API_KEY}")) {
        return Err(axum::http::StatusCode::UNAUTHORIZED);
    }
    let (engine, port) = state;
    let engine = engine.lock().unwrap();
    Ok(Json(json!({
        "seq": engine.seq,
        "block_size": 16,
        "kv_events_port": port,
        "block_hashes": engine.hashes.iter().collect::<Vec<_>>(),
    })))
}

/// A fake replica; returns it and its base URL.
async fn start_replica() -> (FakeEngine, String) {
    let mut publisher = PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let events_port = match endpoint {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("bound {other}"),
    };
    assert!(events_port > 0);
    let state = Arc::new(Mutex::new(EngineState::default()));
    let app = Router::new()
        .route("/sluice/kv_cache", get(snapshot))
        .with_state((state.clone(), events_port));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (FakeEngine { state, publisher }, url)
}

async fn until_index_equals(policy: &CacheAwarePolicy, url: &str, engine: &FakeEngine) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let index = policy
            .index_snapshot()
            .get(url)
            .cloned()
            .unwrap_or_default();
        let expected = engine.hashes();
        if index == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the router's index {index:?} never became the engine's {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn model_dir() -> std::path::PathBuf {
    const NAME: &str = "SmolLM2-135M-Instruct";
    if let Some(dir) = std::env::var_os("SLUICE_MODEL_DIR") {
        return dir.into();
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    std::path::PathBuf::from(home)
        .join(".cache/sluice/models")
        .join(NAME)
}

fn chain(seed: u32, blocks: u32) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..blocks * 16).map(|i| seed * 10_000 + i).collect();
    block_hashes(&tokens, 16, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_the_engine_through_events_gaps_and_clears() {
    let (mut engine, url) = start_replica().await;
    let policy = CacheAwarePolicy::new(CacheAwareConfig {
        balance_abs: 8,
        balance_rel: 1.5,
        model_dir: Some(model_dir()),
        api_key: Some(API_KEY.into()),
        pending_window: std::time::Duration::ZERO,
    })
    .unwrap();
    let a = chain(1, 4);
    // State from before the router subscribed reaches it through the first snapshot.
    engine
        .step(
            vec![
                KvEvent::stored(a[0], None),
                KvEvent::stored(a[1], Some(a[0])),
            ],
            false,
        )
        .await;
    policy.replicas_changed(&[ReplicaId(Arc::from(url.as_str()))]);
    until_index_equals(&policy, &url, &engine).await;

    // Events after it, in order.
    engine
        .step(vec![KvEvent::stored(a[2], Some(a[1]))], false)
        .await;
    engine.step(vec![KvEvent::removed(a[0])], false).await;
    until_index_equals(&policy, &url, &engine).await;
    assert_eq!(engine.hashes().len(), 2);

    // A lost message: the next one shows the gap, and the snapshot repairs what was missed.
    let b = chain(2, 3);
    engine
        .step(
            vec![KvEvent::stored(b[0], None), KvEvent::removed(a[1])],
            true,
        )
        .await;
    engine
        .step(vec![KvEvent::stored(b[1], Some(b[0]))], false)
        .await;
    until_index_equals(&policy, &url, &engine).await;
    assert!(engine.hashes().contains(&to_hex(&b[0])));

    // A reset, then more: all_cleared empties the index.
    engine
        .step(
            vec![KvEvent::AllCleared, KvEvent::stored(b[2], None)],
            false,
        )
        .await;
    until_index_equals(&policy, &url, &engine).await;
    assert_eq!(engine.hashes(), vec![to_hex(&b[2])]);

    // A replica that leaves the list is forgotten, and its subscriber stops.
    policy.replicas_changed(&[]);
    assert!(policy.index_snapshot().is_empty());
}
