//! The frontend side of the ZeroMQ seam to the engine core (`docs/protocol.md`).
//!
//! One actor task owns all the state: the per-request output channels, the
//! pending utility calls and the engine's health. Handles talk to it over a
//! command channel, so nothing is shared behind a lock. Two more tasks own the
//! sockets, so that a slow socket never stalls routing: the writer sends
//! encoded frames on the PUSH socket, the reader decodes frames from the PULL
//! socket and watches it for the engine going away.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use zeromq::{
    PullSocket, PushSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage,
};

use crate::engine::protocol::{
    self, Abort, AddRequest, EngineOutput, EngineStats, Message, Ready, UtilityCall, UtilityMethod,
    UtilityValue,
};

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EngineError {
    #[error("engine address {0:?} is neither ipc:// nor loopback tcp://")]
    Address(String),
    #[error("cannot connect to the engine core at {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("the engine core sent no ready message within {0:?}")]
    ReadyTimeout(Duration),
    #[error("the engine core broke the protocol: {0}")]
    Protocol(String),
    #[error("the engine core is dead: {0}")]
    Dead(String),
    #[error("utility call failed in the engine core: {0}")]
    Utility(String),
    #[error("utility call got no answer within {0:?}")]
    UtilityTimeout(Duration),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    Healthy,
    /// Terminal: a dead engine never comes back to this client.
    Dead(String),
}

#[derive(Debug, Clone)]
pub struct EngineClientConfig {
    pub input_address: String,
    pub output_address: String,
    /// Covers the engine's start-up: binding, loading the model, allocating the KV cache.
    pub ready_timeout: Duration,
    /// After this much silence the client sends a health probe.
    pub probe_interval: Duration,
    /// After this much silence the engine is declared dead.
    pub health_timeout: Duration,
    pub utility_timeout: Duration,
}

impl EngineClientConfig {
    pub fn new(input_address: impl Into<String>, output_address: impl Into<String>) -> Self {
        EngineClientConfig {
            input_address: input_address.into(),
            output_address: output_address.into(),
            ready_timeout: Duration::from_secs(600),
            probe_interval: Duration::from_secs(1),
            // Far above one engine step, so that only a hung engine trips it.
            health_timeout: Duration::from_secs(15),
            utility_timeout: Duration::from_secs(10),
        }
    }
}

/// Accepts `ipc://<path>` and `tcp://<loopback ip>:<port>` only, so the seam
/// is never reachable from another machine.
pub fn validate_address(address: &str) -> Result<(), EngineError> {
    let invalid = || EngineError::Address(address.to_owned());
    if let Some(path) = address.strip_prefix("ipc://") {
        return if path.is_empty() {
            Err(invalid())
        } else {
            Ok(())
        };
    }
    if let Some(host_port) = address.strip_prefix("tcp://") {
        let socket: SocketAddr = host_port.parse().map_err(|_| invalid())?;
        if socket.ip().is_loopback() {
            return Ok(());
        }
    }
    Err(invalid())
}

type UtilityReply = oneshot::Sender<Result<Option<UtilityValue>, EngineError>>;

enum Command {
    Add {
        request: AddRequest,
        outputs: mpsc::UnboundedSender<EngineOutput>,
    },
    Abort(Vec<String>),
    /// The request's [`OutputStream`] was dropped before it finished.
    Release(String),
    Utility {
        method: UtilityMethod,
        reply: UtilityReply,
    },
    MarkDead(String),
}

enum Event {
    Message(Message),
    Failed(String),
}

/// A cheap, cloneable handle to the engine core.
#[derive(Clone)]
pub struct EngineClient {
    commands: mpsc::UnboundedSender<Command>,
    health: watch::Receiver<EngineHealth>,
    stats: watch::Receiver<Option<EngineStats>>,
    ready: Ready,
    utility_timeout: Duration,
}

impl EngineClient {
    /// Connects both sockets and waits for the engine's `ready`.
    pub async fn connect(config: EngineClientConfig) -> Result<Self, EngineError> {
        validate_address(&config.input_address)?;
        validate_address(&config.output_address)?;
        let connect_error = |address: &str, err: zeromq::ZmqError| EngineError::Connect {
            address: address.to_owned(),
            reason: err.to_string(),
        };
        let options = || {
            let mut options = SocketOptions::default();
            // The engine binds its sockets early but may still be starting Python.
            options.connect_timeout(config.ready_timeout);
            options
        };

        let mut push = PushSocket::with_options(options());
        push.connect(&config.input_address)
            .await
            .map_err(|err| connect_error(&config.input_address, err))?;
        let mut pull = PullSocket::with_options(options());
        let monitor = pull.monitor();
        pull.connect(&config.output_address)
            .await
            .map_err(|err| connect_error(&config.output_address, err))?;

        let ready = tokio::time::timeout(config.ready_timeout, next_message(&mut pull))
            .await
            .map_err(|_| EngineError::ReadyTimeout(config.ready_timeout))??;
        let ready = match ready {
            Message::Ready(ready) => ready,
            other => {
                return Err(EngineError::Protocol(format!(
                    "expected ready, got {}",
                    other.type_name()
                )))
            }
        };

        let (commands_tx, commands_rx) = mpsc::unbounded_channel();
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (frames_tx, frames_rx) = mpsc::unbounded_channel();
        let (health_tx, health_rx) = watch::channel(EngineHealth::Healthy);
        let (stats_tx, stats_rx) = watch::channel(None);
        let socket_tasks = vec![
            tokio::spawn(write_frames(push, frames_rx, events_tx.clone())),
            tokio::spawn(read_frames(pull, monitor, events_tx)),
        ];
        let actor = Actor {
            frames: frames_tx,
            requests: HashMap::new(),
            calls: HashMap::new(),
            next_call_id: 0,
            last_heard: Instant::now(),
            probe_outstanding: false,
            health: health_tx,
            stats: stats_tx,
            probe_interval: config.probe_interval,
            health_timeout: config.health_timeout,
            socket_tasks,
        };
        tokio::spawn(actor.run(commands_rx, events_rx));

        Ok(EngineClient {
            commands: commands_tx,
            health: health_rx,
            stats: stats_rx,
            ready,
            utility_timeout: config.utility_timeout,
        })
    }

    /// What the engine announced in its `ready` message.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// Sends the request; its outputs arrive on the returned stream, which ends
    /// after the output carrying a finish reason. Dropping the stream before
    /// then aborts the request in the engine.
    pub fn add_request(&self, request: AddRequest) -> Result<OutputStream, EngineError> {
        if let EngineHealth::Dead(reason) = self.health() {
            return Err(EngineError::Dead(reason));
        }
        let (outputs_tx, outputs_rx) = mpsc::unbounded_channel();
        let request_id = request.request_id.clone();
        self.send(Command::Add {
            request,
            outputs: outputs_tx,
        })?;
        Ok(OutputStream {
            request_id,
            outputs: outputs_rx,
            commands: self.commands.clone(),
            finished: false,
        })
    }

    /// Ends these requests in the engine; each stream still gets its final `abort` output.
    pub fn abort(&self, request_ids: Vec<String>) {
        let _ = self.send(Command::Abort(request_ids));
    }

    pub async fn utility(
        &self,
        method: UtilityMethod,
    ) -> Result<Option<UtilityValue>, EngineError> {
        let (reply_tx, reply_rx) = oneshot::channel();
        self.send(Command::Utility {
            method,
            reply: reply_tx,
        })?;
        match tokio::time::timeout(self.utility_timeout, reply_rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(EngineError::Dead("engine client stopped".into())),
            Err(_) => Err(EngineError::UtilityTimeout(self.utility_timeout)),
        }
    }

    pub fn is_healthy(&self) -> bool {
        matches!(*self.health.borrow(), EngineHealth::Healthy)
    }

    pub fn health(&self) -> EngineHealth {
        self.health.borrow().clone()
    }

    /// Resolves with the reason once the engine is dead, so the server can exit non-zero.
    pub async fn dead(&self) -> String {
        let mut health = self.health.clone();
        loop {
            if let EngineHealth::Dead(reason) = &*health.borrow_and_update() {
                return reason.clone();
            }
            if health.changed().await.is_err() {
                return "engine client stopped".into();
            }
        }
    }

    /// For whoever supervises the engine process and sees it exit first.
    pub fn mark_dead(&self, reason: impl Into<String>) {
        let _ = self.send(Command::MarkDead(reason.into()));
    }

    /// The counters from the engine's latest step or stats call.
    pub fn latest_stats(&self) -> Option<EngineStats> {
        self.stats.borrow().clone()
    }

    pub fn stats_watch(&self) -> watch::Receiver<Option<EngineStats>> {
        self.stats.clone()
    }

    fn send(&self, command: Command) -> Result<(), EngineError> {
        self.commands
            .send(command)
            .map_err(|_| EngineError::Dead("engine client stopped".into()))
    }
}

/// One request's outputs, in order; the last one has a finish reason.
pub struct OutputStream {
    request_id: String,
    outputs: mpsc::UnboundedReceiver<EngineOutput>,
    commands: mpsc::UnboundedSender<Command>,
    finished: bool,
}

impl OutputStream {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub async fn recv(&mut self) -> Option<EngineOutput> {
        let output = self.outputs.recv().await;
        self.note(output.as_ref());
        output
    }

    fn note(&mut self, output: Option<&EngineOutput>) {
        if output.is_none_or(EngineOutput::is_finished) {
            self.finished = true;
        }
    }
}

impl Stream for OutputStream {
    type Item = EngineOutput;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<EngineOutput>> {
        let polled = self.outputs.poll_recv(cx);
        if let Poll::Ready(output) = &polled {
            self.note(output.as_ref());
        }
        polled
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self
                .commands
                .send(Command::Release(std::mem::take(&mut self.request_id)));
        }
    }
}

struct Actor {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    requests: HashMap<String, mpsc::UnboundedSender<EngineOutput>>,
    /// `None` marks the actor's own health probe.
    calls: HashMap<u64, Option<UtilityReply>>,
    next_call_id: u64,
    last_heard: Instant,
    probe_outstanding: bool,
    health: watch::Sender<EngineHealth>,
    stats: watch::Sender<Option<EngineStats>>,
    probe_interval: Duration,
    health_timeout: Duration,
    socket_tasks: Vec<JoinHandle<()>>,
}

impl Actor {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut events: mpsc::UnboundedReceiver<Event>,
    ) {
        let mut ticks = tokio::time::interval(self.probe_interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
                Some(event) = events.recv() => self.on_event(event),
                _ = ticks.tick() => self.check_liveness(),
            }
        }
        self.stop_sockets();
    }

    fn is_dead(&self) -> bool {
        matches!(*self.health.borrow(), EngineHealth::Dead(_))
    }

    fn dead_reason(&self) -> Option<String> {
        match &*self.health.borrow() {
            EngineHealth::Dead(reason) => Some(reason.clone()),
            EngineHealth::Healthy => None,
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Add { request, outputs } => {
                if let Some(reason) = self.dead_reason() {
                    let _ = outputs.send(failed(&request.request_id, &reason));
                } else if self.requests.contains_key(&request.request_id) {
                    let _ = outputs.send(EngineOutput::failed(
                        &request.request_id,
                        "request id is already in flight",
                    ));
                } else {
                    self.requests.insert(request.request_id.clone(), outputs);
                    self.send(request.into());
                }
            }
            Command::Abort(request_ids) => {
                if !self.is_dead() && !request_ids.is_empty() {
                    self.send(Abort { request_ids }.into());
                }
            }
            Command::Release(request_id) => {
                if self.requests.remove(&request_id).is_some() && !self.is_dead() {
                    self.send(
                        Abort {
                            request_ids: vec![request_id],
                        }
                        .into(),
                    );
                }
            }
            Command::Utility { method, reply } => match self.dead_reason() {
                Some(reason) => {
                    let _ = reply.send(Err(EngineError::Dead(reason)));
                }
                None => self.call(method, Some(reply)),
            },
            Command::MarkDead(reason) => self.die(reason),
        }
    }

    fn on_event(&mut self, event: Event) {
        if self.is_dead() {
            return;
        }
        let message = match event {
            Event::Message(message) => message,
            Event::Failed(reason) => return self.die(reason),
        };
        self.last_heard = Instant::now();
        match message {
            Message::Outputs(step) => {
                let mut dropped = Vec::new();
                for output in step.outputs {
                    let finished = output.is_finished();
                    // Frames for unknown ids belong to requests already released or failed.
                    let Some(outputs) = self.requests.get(&output.request_id) else {
                        continue;
                    };
                    let request_id = output.request_id.clone();
                    if outputs.send(output).is_err() {
                        self.requests.remove(&request_id);
                        if !finished {
                            dropped.push(request_id);
                        }
                    } else if finished {
                        self.requests.remove(&request_id);
                    }
                }
                if !dropped.is_empty() {
                    self.send(
                        Abort {
                            request_ids: dropped,
                        }
                        .into(),
                    );
                }
                self.stats.send_replace(Some(step.stats));
            }
            Message::UtilityResult(result) => {
                if let Some(UtilityValue::Stats(stats)) = &result.result {
                    self.stats.send_replace(Some(stats.clone()));
                }
                match self.calls.remove(&result.call_id) {
                    Some(Some(reply)) => {
                        let _ = reply.send(match result.error {
                            Some(error) => Err(EngineError::Utility(error)),
                            None => Ok(result.result),
                        });
                    }
                    Some(None) => self.probe_outstanding = false,
                    None => {}
                }
            }
            // The spec sends ready once; a repeat carries nothing to act on.
            Message::Ready(_) => {}
            other => self.die(format!(
                "engine core sent a {} message, which only the frontend sends",
                other.type_name()
            )),
        }
    }

    fn check_liveness(&mut self) {
        if self.is_dead() {
            return;
        }
        let silence = self.last_heard.elapsed();
        if silence >= self.health_timeout {
            self.die(format!("engine core did not answer for {silence:?}"));
        } else if silence >= self.probe_interval && !self.probe_outstanding {
            self.probe_outstanding = true;
            self.call(UtilityMethod::Health, None);
        }
    }

    fn call(&mut self, method: UtilityMethod, reply: Option<UtilityReply>) {
        let call_id = self.next_call_id;
        self.next_call_id += 1;
        // Callers that gave up (timed out) leave entries whose replies have nowhere to go.
        self.calls
            .retain(|_, reply| reply.as_ref().is_none_or(|reply| !reply.is_closed()));
        self.calls.insert(call_id, reply);
        self.send(UtilityCall { call_id, method }.into());
    }

    fn send(&mut self, message: Message) {
        // The writer reports its own failure as an event; a send error here means it already has.
        let _ = self.frames.send(protocol::encode(&message));
    }

    /// Every request in flight ends with an error and every call fails: nothing hangs.
    fn die(&mut self, reason: String) {
        if self.is_dead() {
            return;
        }
        for (request_id, outputs) in self.requests.drain() {
            let _ = outputs.send(failed(&request_id, &reason));
        }
        for (_, reply) in self.calls.drain() {
            if let Some(reply) = reply {
                let _ = reply.send(Err(EngineError::Dead(reason.clone())));
            }
        }
        self.health.send_replace(EngineHealth::Dead(reason));
        self.stop_sockets();
    }

    fn stop_sockets(&mut self) {
        for task in self.socket_tasks.drain(..) {
            task.abort();
        }
    }
}

fn failed(request_id: &str, reason: &str) -> EngineOutput {
    EngineOutput::failed(request_id, format!("engine core failed: {reason}"))
}

async fn next_message(pull: &mut PullSocket) -> Result<Message, EngineError> {
    let frame = pull
        .recv()
        .await
        .map_err(|err| EngineError::Dead(format!("output socket: {err}")))?;
    decode_frame(frame).map_err(EngineError::Protocol)
}

fn decode_frame(frame: ZmqMessage) -> Result<Message, String> {
    if frame.len() != 1 {
        return Err(format!("expected one msgpack frame, got {}", frame.len()));
    }
    let body = frame.get(0).expect("length checked");
    protocol::decode(body).map_err(|err| err.to_string())
}

async fn write_frames(
    mut push: PushSocket,
    mut frames: mpsc::UnboundedReceiver<Vec<u8>>,
    events: mpsc::UnboundedSender<Event>,
) {
    while let Some(frame) = frames.recv().await {
        if let Err(err) = push.send(ZmqMessage::from(frame)).await {
            let _ = events.send(Event::Failed(format!("input socket: {err}")));
            return;
        }
    }
}

async fn read_frames(
    mut pull: PullSocket,
    mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    events: mpsc::UnboundedSender<Event>,
) {
    loop {
        let event = tokio::select! {
            frame = pull.recv() => match frame {
                Ok(frame) => match decode_frame(frame) {
                    Ok(message) => Event::Message(message),
                    // The spec: a frame the frontend cannot read is an engine failure.
                    Err(reason) => Event::Failed(format!("undecodable frame: {reason}")),
                },
                Err(err) => Event::Failed(format!("output socket: {err}")),
            },
            // The fair queue reports the peer's EOF only after its last frame was
            // returned, so no output is lost by stopping here.
            Some(SocketEvent::Disconnected(_)) = monitor.next() => {
                Event::Failed("engine core disconnected".into())
            }
        };
        let last = matches!(event, Event::Failed(_));
        if events.send(event).is_err() || last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ipc_and_loopback_tcp_are_accepted() {
        for ok in [
            "ipc:///tmp/sluice-1/input",
            "tcp://127.0.0.1:5555",
            "tcp://127.0.0.2:1",
            "tcp://[::1]:5555",
        ] {
            assert_eq!(validate_address(ok), Ok(()), "{ok}");
        }
        for bad in [
            "ipc://",
            "tcp://0.0.0.0:5555",
            "tcp://10.0.0.1:5555",
            "tcp://localhost:5555",
            "tcp://127.0.0.1",
            "tcp://[::]:5555",
            "inproc://x",
            "udp://127.0.0.1:5555",
            "",
        ] {
            assert_eq!(
                validate_address(bad),
                Err(EngineError::Address(bad.to_owned())),
                "{bad}"
            );
        }
    }
}
