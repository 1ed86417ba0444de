//! One task per replica that keeps its [`KvIndex`] in step with the replica's engine core: it
//! reads `GET /sluice/kv_cache` to learn the KV-events port, subscribes to it, reads the snapshot
//! again (so that nothing published after the subscription is missed), then applies each message.
//! A gap in `seq`, an undecodable message or a reconnection (the engine may have restarted)
//! sends it back to the snapshot. While it has no snapshot the index is unsynced and the policy
//! falls back to its approximate tree.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Empty};
use hyper::header::AUTHORIZATION;
use hyper::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

use super::kv_events;
use super::kv_index::{Applied, KvIndex, Snapshot};

/// Between attempts to reach a replica that is down or publishes no events.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(5);
/// ZeroMQ retries a refused connection for ever; after this long the router says so (once) and
/// starts over, so that a socket bound where the router cannot reach it is not a silent fallback.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A subscription reaches the publisher a moment after connect; the snapshot waits that long so
/// that a message published in between is rarely lost (a loss shows as a gap, then a resync).
const SUBSCRIBE_SETTLE: Duration = Duration::from_millis(50);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A running subscriber; dropping it stops the task.
pub struct Subscription {
    pub index: Arc<RwLock<KvIndex>>,
    task: JoinHandle<()>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts following the replica at `base_url` (`http://host:port`) on the current tokio runtime.
/// `api_key` is sent with the snapshot requests, for replicas that require one.
pub fn subscribe(
    runtime: &tokio::runtime::Handle,
    base_url: &str,
    api_key: Option<&str>,
) -> Subscription {
    let index = Arc::new(RwLock::new(KvIndex::default()));
    let authorization = api_key.map(|key| format!("Bearer {key}"));
    let task = runtime.spawn(follow(
        base_url.trim_end_matches('/').to_owned(),
        authorization,
        index.clone(),
    ));
    Subscription { index, task }
}

/// A replica's HTTP side, where its snapshots come from.
struct SnapshotSource {
    client: HttpClient,
    base_url: String,
    /// `Bearer KEY`, for replicas that require a key.
    authorization: Option<String>,
}

async fn follow(base_url: String, authorization: Option<String>, index: Arc<RwLock<KvIndex>>) {
    let source = SnapshotSource {
        client: Client::builder(TokioExecutor::new()).build_http(),
        base_url: base_url.clone(),
        authorization,
    };
    let host = match base_url
        .parse::<Uri>()
        .ok()
        .and_then(|uri| uri.host().map(str::to_owned))
    {
        Some(host) => host,
        None => {
            eprintln!("sluice-router: cache-aware: {base_url} has no host; no KV events from it");
            return;
        }
    };
    let mut reported = String::new();
    loop {
        let outcome = match source.snapshot().await {
            Ok(Snapshot {
                kv_events_port: Some(port),
                ..
            }) => follow_events(&source, &host, port, &index).await,
            Ok(_) => Err("it publishes no KV events (no --kv-events-port)".to_owned()),
            Err(err) => Err(err),
        };
        unsync(&index);
        if let Err(reason) = outcome {
            // Said once per new reason, not once a second.
            if reason != reported {
                eprintln!(
                    "sluice-router: cache-aware: {base_url}: {reason}; using the approximate tree"
                );
                reported = reason;
            }
        }
        tokio::time::sleep(RETRY_INTERVAL).await;
    }
}

/// Subscribes, then follows the events until something breaks; returns why.
async fn follow_events(
    source: &SnapshotSource,
    host: &str,
    port: u16,
    index: &RwLock<KvIndex>,
) -> Result<(), String> {
    let mut socket = SubSocket::new();
    let mut monitor = socket.monitor();
    let endpoint = format!("tcp://{host}:{port}");
    tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(&endpoint))
        .await
        .map_err(|_| {
            format!(
                "cannot connect to {endpoint} in {} s (does the replica bind its KV events where \
                 the router can reach them? see --kv-events-host)",
                CONNECT_TIMEOUT.as_secs()
            )
        })?
        .map_err(|err| format!("cannot connect to {endpoint}: {err}"))?;
    socket
        .subscribe("")
        .await
        .map_err(|err| format!("cannot subscribe to {endpoint}: {err}"))?;
    tokio::time::sleep(SUBSCRIBE_SETTLE).await;
    resync(source, port, index).await?;
    loop {
        tokio::select! {
            frame = socket.recv() => {
                let frame = frame.map_err(|err| format!("{endpoint}: {err}"))?;
                let message = match frame.get(0).map(|body| kv_events::decode(body)) {
                    Some(Ok(message)) if frame.len() == 1 => message,
                    _ => {
                        eprintln!("sluice-router: cache-aware: {endpoint} sent an undecodable message; resyncing");
                        resync(source, port, index).await?;
                        continue;
                    }
                };
                let applied = index.write().expect("the index lock is never poisoned").apply(&message);
                if let Applied::Gap { expected, got } = applied {
                    eprintln!("sluice-router: cache-aware: {endpoint}: seq {got} after a gap (expected {expected}); resyncing");
                    resync(source, port, index).await?;
                }
            }
            event = monitor.next() => match event {
                Some(SocketEvent::Disconnected(_)) => unsync(index),
                // The socket reconnects by itself; the engine behind it may be a new one.
                Some(SocketEvent::Connected(..)) => resync(source, port, index).await?,
                Some(_) => {}
                None => return Err(format!("{endpoint}: the socket monitor closed")),
            },
        }
    }
}

/// Resets the index from a fresh snapshot; an error when the replica no longer publishes there.
async fn resync(source: &SnapshotSource, port: u16, index: &RwLock<KvIndex>) -> Result<(), String> {
    unsync(index);
    let snapshot = source.snapshot().await?;
    if snapshot.kv_events_port != Some(port) {
        return Err(format!(
            "its KV-events port changed from {port} to {:?}",
            snapshot.kv_events_port
        ));
    }
    index
        .write()
        .expect("the index lock is never poisoned")
        .reset(&snapshot)
        .map_err(|err| format!("a bad snapshot: {err}"))
}

fn unsync(index: &RwLock<KvIndex>) {
    index
        .write()
        .expect("the index lock is never poisoned")
        .unsync();
}

impl SnapshotSource {
    /// `GET {base_url}/sluice/kv_cache`.
    async fn snapshot(&self) -> Result<Snapshot, String> {
        let (client, base_url) = (&self.client, &self.base_url);
        let url = format!("{base_url}/sluice/kv_cache");
        let uri: Uri = url.parse().map_err(|err| format!("{url}: {err}"))?;
        let mut request = Request::get(uri);
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization);
        }
        let request = request
            .body(Empty::new())
            .map_err(|err| format!("{url}: {err}"))?;
        let fetch = async {
            let response = client
                .request(request)
                .await
                .map_err(|err| err.to_string())?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|err| err.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("HTTP {status}"));
            }
            serde_json::from_slice::<Snapshot>(&body)
                .map_err(|err| format!("not a snapshot: {err}"))
        };
        match tokio::time::timeout(SNAPSHOT_TIMEOUT, fetch).await {
            Ok(result) => result.map_err(|err| format!("GET {url}: {err}")),
            Err(_) => Err(format!("GET {url}: no answer within {SNAPSHOT_TIMEOUT:?}")),
        }
    }
}
