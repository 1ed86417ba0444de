//! The engine client against a fake engine core: a task with the engine's
//! side of the seam (PULL and PUSH bound on ipc:// in a temporary directory)
//! that the test drives message by message.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluice_frontend::engine::client::{EngineClient, EngineHealth, OutputStream};
use sluice_frontend::engine::client_config::EngineClientConfig;
use sluice_frontend::engine::error::EngineError;
use sluice_frontend::engine::protocol::{
    decode, encode, Abort, AddRequest, EngineOutput, EngineStats, FinishReason, Message, Outputs,
    Ready, Runner, SamplingParams, UtilityMethod, UtilityResult, UtilityValue,
};
use zeromq::{PullSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const PATIENCE: Duration = Duration::from_secs(5);

struct FakeEngine {
    input: PullSocket,
    output: PushSocket,
    dir: PathBuf,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl FakeEngine {
    /// Closes its sockets as a killed process's would. Dropping a socket stops its listener only
    /// later, and a client reconnecting in between would connect to the dead engine's listener.
    async fn die(mut self) {
        self.input.unbind_all().await;
        self.output.unbind_all().await;
    }

    async fn recv(&mut self) -> Message {
        let frame = tokio::time::timeout(PATIENCE, self.input.recv())
            .await
            .expect("the client sent nothing")
            .unwrap();
        decode(frame.get(0).unwrap()).unwrap()
    }

    async fn send(&mut self, message: Message) {
        self.output
            .send(ZmqMessage::from(encode(&message)))
            .await
            .unwrap();
    }

    async fn recv_add(&mut self) -> AddRequest {
        match self.recv().await {
            Message::AddRequest(request) => *request,
            other => panic!("expected add_request, got {other:?}"),
        }
    }
}

fn temp_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "sluice-engine-client-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn addresses(dir: &std::path::Path) -> (String, String) {
    (
        format!("ipc://{}/input", dir.display()),
        format!("ipc://{}/output", dir.display()),
    )
}

impl FakeEngine {
    /// Binds the engine's side of the seam in `dir`.
    async fn bind(dir: PathBuf) -> FakeEngine {
        let (input_address, output_address) = addresses(&dir);
        let mut input = PullSocket::new();
        input.bind(&input_address).await.unwrap();
        let mut output = PushSocket::new();
        output.bind(&output_address).await.unwrap();
        FakeEngine { input, output, dir }
    }

    /// Sends `ready` once the client's PULL has connected (a bound PUSH socket refuses to send before).
    async fn send_ready(&mut self) {
        let ready = Message::Ready(Ready {
            max_model_len: 2048,
            num_kv_blocks: 100,
            block_size: 16,
            runner: Runner::Generate,
            embedding_size: 0,
            matryoshka_dimensions: None,
            cross_encoder: false,
            eos_token_ids: vec![2],
        });
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self
            .output
            .send(ZmqMessage::from(encode(&ready)))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "client never connected"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Binds the fake engine, connects a client to it and completes the ready handshake.
async fn start(tune: impl FnOnce(&mut EngineClientConfig)) -> (FakeEngine, EngineClient) {
    let mut engine = FakeEngine::bind(temp_dir()).await;
    let (input_address, output_address) = addresses(&engine.dir);
    let mut config = EngineClientConfig::new(input_address, output_address);
    config.ready_timeout = PATIENCE;
    tune(&mut config);
    let client = tokio::spawn(EngineClient::connect(config));
    engine.send_ready().await;
    let client = client.await.unwrap().unwrap();
    assert_eq!(client.ready().max_model_len, 2048);
    (engine, client)
}

fn request(id: &str) -> AddRequest {
    AddRequest {
        request_id: id.into(),
        prompt_token_ids: vec![1, 2, 3],
        params: SamplingParams::default(),
        arrival_time: 0.0,
        priority: 0,
        cache_salt: None,
        pooling: None,
        second_text_start: None,
    }
}

fn output(id: &str, tokens: &[u32], finish: Option<FinishReason>) -> EngineOutput {
    EngineOutput {
        request_id: id.into(),
        new_token_ids: tokens.to_vec(),
        new_logprobs: None,
        finish_reason: finish,
        stop_reason: None,
        num_cached_tokens: 0,
        error: None,
        first_scheduled_time: None,
        invalid_param: None,
        prompt_logprobs: None,
        embedding: None,
    }
}

fn step(outputs: Vec<EngineOutput>, num_running: u64) -> Message {
    Message::Outputs(Outputs {
        outputs,
        stats: EngineStats {
            num_running,
            ..EngineStats::default()
        },
        timestamp: 0.0,
    })
}

async fn next(stream: &mut OutputStream) -> Option<EngineOutput> {
    tokio::time::timeout(PATIENCE, stream.recv())
        .await
        .expect("no output arrived")
}

async fn tokens_until_finished(stream: &mut OutputStream) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    loop {
        let output = next(stream).await.expect("stream ended without a finish");
        assert_eq!(output.request_id, stream.request_id());
        tokens.extend(output.new_token_ids);
        if let Some(reason) = output.finish_reason {
            return (tokens, reason);
        }
    }
}

#[tokio::test]
async fn interleaved_outputs_reach_their_own_requests() {
    let (mut engine, client) = start(|_| {}).await;
    let mut a = client.add_request(request("a")).unwrap();
    let mut b = client.add_request(request("b")).unwrap();
    assert_eq!(engine.recv_add().await.request_id, "a");
    assert_eq!(engine.recv_add().await.request_id, "b");

    engine
        .send(step(
            vec![output("a", &[10], None), output("b", &[20], None)],
            2,
        ))
        .await;
    engine
        .send(step(
            vec![
                output("b", &[21], None),
                output("stale", &[99], None),
                output("a", &[11, 12], Some(FinishReason::Length)),
            ],
            2,
        ))
        .await;
    engine
        .send(step(vec![output("b", &[], Some(FinishReason::Stop))], 0))
        .await;

    assert_eq!(
        tokens_until_finished(&mut a).await,
        (vec![10, 11, 12], FinishReason::Length)
    );
    assert_eq!(
        tokens_until_finished(&mut b).await,
        (vec![20, 21], FinishReason::Stop)
    );
    // A finished request's channel closes after its final output.
    assert!(next(&mut a).await.is_none());
    assert!(next(&mut b).await.is_none());
    assert_eq!(client.latest_stats().unwrap().num_running, 0);
    assert!(client.is_healthy());
}

#[tokio::test]
async fn dropping_a_stream_aborts_its_request() {
    let (mut engine, client) = start(|_| {}).await;
    let waiting = client.add_request(request("waiting")).unwrap();
    let mut running = client.add_request(request("running")).unwrap();
    engine.recv_add().await;
    engine.recv_add().await;
    engine
        .send(step(vec![output("running", &[1], None)], 1))
        .await;
    assert_eq!(next(&mut running).await.unwrap().new_token_ids, vec![1]);

    drop(waiting);
    assert_eq!(
        engine.recv().await,
        Message::Abort(Abort {
            request_ids: vec!["waiting".into()]
        })
    );
    drop(running);
    assert_eq!(
        engine.recv().await,
        Message::Abort(Abort {
            request_ids: vec!["running".into()]
        })
    );
    // The engine's late frames for released requests are dropped harmlessly.
    engine
        .send(step(
            vec![output("running", &[], Some(FinishReason::Abort))],
            0,
        ))
        .await;
    let mut after = client.add_request(request("after")).unwrap();
    engine.recv_add().await;
    engine
        .send(step(
            vec![output("after", &[7], Some(FinishReason::Stop))],
            0,
        ))
        .await;
    assert_eq!(
        tokens_until_finished(&mut after).await,
        (vec![7], FinishReason::Stop)
    );
    assert!(client.is_healthy());
}

#[tokio::test]
async fn explicit_abort_reaches_the_engine_and_the_stream_sees_its_end() {
    let (mut engine, client) = start(|_| {}).await;
    let mut stream = client.add_request(request("x")).unwrap();
    engine.recv_add().await;
    client.abort(vec!["x".into()]);
    assert_eq!(
        engine.recv().await,
        Message::Abort(Abort {
            request_ids: vec!["x".into()]
        })
    );
    engine
        .send(step(vec![output("x", &[], Some(FinishReason::Abort))], 0))
        .await;
    assert_eq!(
        tokens_until_finished(&mut stream).await,
        (vec![], FinishReason::Abort)
    );
}

#[tokio::test]
async fn utility_calls_are_answered_by_call_id() {
    let (mut engine, client) = start(|_| {}).await;
    let call = {
        let client = client.clone();
        tokio::spawn(async move { client.utility(UtilityMethod::Stats).await })
    };
    let call_id = match engine.recv().await {
        Message::UtilityCall(utility) => {
            assert_eq!(utility.method, UtilityMethod::Stats);
            utility.call_id
        }
        other => panic!("expected utility, got {other:?}"),
    };
    let stats = EngineStats {
        num_waiting: 3,
        kv_cache_usage: 0.25,
        ..EngineStats::default()
    };
    engine
        .send(Message::UtilityResult(UtilityResult {
            call_id,
            result: Some(UtilityValue::Stats(stats.clone())),
            error: None,
        }))
        .await;
    assert_eq!(
        call.await.unwrap().unwrap(),
        Some(UtilityValue::Stats(stats.clone()))
    );
    assert_eq!(client.latest_stats(), Some(stats));

    let call = {
        let client = client.clone();
        tokio::spawn(async move { client.utility(UtilityMethod::Health).await })
    };
    let Message::UtilityCall(utility) = engine.recv().await else {
        panic!("expected utility");
    };
    engine
        .send(Message::UtilityResult(UtilityResult {
            call_id: utility.call_id,
            result: None,
            error: Some("broken".into()),
        }))
        .await;
    assert_eq!(
        call.await.unwrap(),
        Err(EngineError::Utility("broken".into()))
    );
}

async fn assert_failed_in_flight(stream: &mut OutputStream) {
    let last = next(stream).await.expect("a final error output");
    assert_eq!(last.finish_reason, Some(FinishReason::Error));
    assert!(last.error.unwrap().starts_with("engine core failed"));
    assert!(next(stream).await.is_none());
}

async fn assert_dead(client: &EngineClient) {
    let reason = tokio::time::timeout(PATIENCE, client.dead())
        .await
        .expect("engine never declared dead");
    assert!(!client.is_healthy());
    assert!(matches!(
        client.add_request(request("late")),
        Err(EngineError::Dead(r)) if r == reason
    ));
    assert!(matches!(
        client.utility(UtilityMethod::Health).await,
        Err(EngineError::Dead(_))
    ));
}

#[tokio::test]
async fn engine_exit_fails_in_flight_requests_and_turns_unhealthy() {
    // No pid to watch: the socket closing alone must reveal the death.
    let (mut engine, client) = start(|_| {}).await;
    let mut first = client.add_request(request("first")).unwrap();
    let mut second = client.add_request(request("second")).unwrap();
    engine.recv_add().await;
    engine.recv_add().await;
    engine
        .send(step(vec![output("first", &[5], None)], 2))
        .await;
    assert_eq!(next(&mut first).await.unwrap().new_token_ids, vec![5]);

    drop(engine);
    assert_failed_in_flight(&mut first).await;
    assert_failed_in_flight(&mut second).await;
    assert_dead(&client).await;
}

#[tokio::test]
async fn a_silent_engine_stays_healthy_while_connected() {
    // An engine core answers only between steps: a long step is silence, not death.
    let (mut engine, client) = start(|_| {}).await;
    let mut stream = client.add_request(request("long")).unwrap();
    engine.recv_add().await;
    let silence = Duration::from_secs(3);
    assert!(
        tokio::time::timeout(silence, engine.input.recv())
            .await
            .is_err(),
        "the client sent something to a silent engine"
    );
    assert!(client.is_healthy());
    engine
        .send(step(
            vec![output("long", &[4], Some(FinishReason::Stop))],
            0,
        ))
        .await;
    assert_eq!(
        tokens_until_finished(&mut stream).await,
        (vec![4], FinishReason::Stop)
    );
}

#[tokio::test]
async fn a_lost_engine_is_replaced_by_the_next_one_on_the_same_addresses() {
    let (mut engine, client) = start(|config| config.reconnect = true).await;
    let mut in_flight = client.add_request(request("in-flight")).unwrap();
    engine.recv_add().await;
    let dir = engine.dir.clone();
    engine.die().await;

    let last = next(&mut in_flight).await.expect("a final error output");
    assert_eq!(last.finish_reason, Some(FinishReason::Error));
    assert!(last.error.unwrap().contains("restarting"));
    assert!(matches!(client.health(), EngineHealth::Restarting(_)));
    assert!(matches!(
        client.add_request(request("meanwhile")),
        Err(EngineError::Restarting(_))
    ));
    assert_eq!(client.restarts(), 0);

    std::fs::create_dir_all(&dir).unwrap();
    let mut successor = FakeEngine::bind(dir).await;
    successor.send_ready().await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !client.is_healthy() {
        assert!(tokio::time::Instant::now() < deadline, "never reconnected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(client.restarts(), 1);
    let mut after = client.add_request(request("after")).unwrap();
    assert_eq!(successor.recv_add().await.request_id, "after");
    successor
        .send(step(
            vec![output("after", &[9], Some(FinishReason::Length))],
            0,
        ))
        .await;
    assert_eq!(
        tokens_until_finished(&mut after).await,
        (vec![9], FinishReason::Length)
    );
}

fn counted(num_running: u64, hits: u64, iteration_tokens: Vec<u64>) -> Message {
    Message::Outputs(Outputs {
        outputs: Vec::new(),
        stats: EngineStats {
            num_running,
            prefix_cache_queries: 2 * hits,
            prefix_cache_hits: hits,
            num_preemptions: 1,
            iteration_tokens_sum: iteration_tokens.iter().sum(),
            iteration_tokens,
            spec_decode_num_accepted_tokens: 3,
            ..EngineStats::default()
        },
        timestamp: 0.0,
    })
}

async fn stats_when(client: &EngineClient, ready: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(stats) = client.latest_stats().filter(|stats| ready(stats)) {
            return stats;
        }
        assert!(tokio::time::Instant::now() < deadline, "no such stats");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn counters_carry_on_across_a_restart_and_gauges_do_not() {
    let (mut engine, client) = start(|config| config.reconnect = true).await;
    engine.send(counted(4, 10, vec![5, 1])).await;
    stats_when(&client, |stats| stats.prefix_cache_hits == 10).await;
    let dir = engine.dir.clone();
    engine.die().await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while client.latest_stats().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lost engine's stats stayed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    std::fs::create_dir_all(&dir).unwrap();
    let mut successor = FakeEngine::bind(dir).await;
    successor.send_ready().await;
    successor.send(counted(1, 4, vec![2, 0, 7])).await;
    let stats = stats_when(&client, |stats| stats.prefix_cache_hits > 4).await;
    assert_eq!(stats.num_running, 1, "a gauge is the live engine core's");
    assert_eq!(
        (stats.prefix_cache_hits, stats.prefix_cache_queries),
        (14, 28)
    );
    assert_eq!(stats.num_preemptions, 2);
    assert_eq!(stats.spec_decode_num_accepted_tokens, 6);
    assert_eq!(stats.iteration_tokens, vec![7, 1, 7]);
    assert_eq!(stats.iteration_tokens_sum, 15);
    // A second report of the same engine core adds nothing twice.
    successor.send(counted(0, 5, vec![2, 0, 7])).await;
    let stats = stats_when(&client, |stats| stats.num_running == 0).await;
    assert_eq!(stats.prefix_cache_hits, 15);
}

#[tokio::test]
async fn undecodable_frame_is_an_engine_failure() {
    let (mut engine, client) = start(|_| {}).await;
    let mut stream = client.add_request(request("r")).unwrap();
    engine.recv_add().await;
    engine
        .output
        .send(ZmqMessage::from(b"\x82\xa1v\x02\xa4type\xa5ready".to_vec()))
        .await
        .unwrap();
    assert_failed_in_flight(&mut stream).await;
    assert_dead(&client).await;
    assert!(client
        .dead()
        .await
        .contains("unsupported protocol version 2"));
}

#[tokio::test]
async fn non_loopback_addresses_are_refused() {
    let config = EngineClientConfig::new("tcp://0.0.0.0:1", "ipc:///tmp/x");
    assert!(matches!(
        EngineClient::connect(config).await,
        Err(EngineError::Address(_))
    ));
}
