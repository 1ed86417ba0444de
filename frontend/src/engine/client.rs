//! The frontend side of the ZeroMQ seam to the engine core (`docs/protocol.md`).
//!
//! One actor task owns all the state: the per-request output channels, the
//! pending utility calls and the engine's health. Handles talk to it over a
//! command channel, so nothing is shared behind a lock. Two more tasks own the
//! sockets, so that a slow socket never stalls routing: the writer sends
//! encoded frames on the PUSH socket, the reader decodes frames from the PULL
//! socket and watches it for the engine going away.
//!
//! Liveness is the connection, never a silence: the engine core answers only
//! between steps, so a long step must not look like a death. The engine core
//! is gone when its socket disconnects (the kernel closes it when the process
//! exits, however it exits) or, when its pid is known, when that process
//! exits. With `reconnect`, a lost engine core is not the end: every request
//! in flight fails, the client reports [`EngineHealth::Restarting`], connects
//! again to the same addresses, and is healthy again once the new engine core
//! sends `ready`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::engine::client_config::{validate_address, EngineClientConfig};
use crate::engine::connection::{
    connect, read_frames, reconnect, wait_for_process_exit, write_frames, Connection, Event, Tagged,
};
use crate::engine::error::EngineError;
use crate::engine::protocol::{
    self, Abort, AddRequest, EngineOutput, EngineStats, Message, Ready, UtilityCall, UtilityMethod,
    UtilityValue,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    Healthy,
    /// The engine core went away and a new one is awaited on the same addresses; the reason
    /// says what happened to the old one.
    Restarting(String),
    /// Terminal: a dead engine never comes back to this client.
    Dead(String),
}

type UtilityReply = oneshot::Sender<Result<Option<UtilityValue>, EngineError>>;

enum Command {
    Add {
        /// Boxed: a request (its structured output spec above all) dwarfs the other commands.
        request: Box<AddRequest>,
        outputs: mpsc::UnboundedSender<EngineOutput>,
    },
    Abort(Vec<String>),
    /// The request's [`OutputStream`] was dropped before it finished.
    Release(String),
    Utility {
        method: UtilityMethod,
        reply: UtilityReply,
    },
}

/// A cheap, cloneable handle to the engine core.
#[derive(Clone)]
pub struct EngineClient {
    commands: mpsc::UnboundedSender<Command>,
    health: watch::Receiver<EngineHealth>,
    stats: watch::Receiver<Option<EngineStats>>,
    restarts: Arc<AtomicU64>,
    ready: Ready,
    utility_timeout: Duration,
}

impl EngineClient {
    /// Connects both sockets and waits for the engine's `ready`.
    pub async fn connect(config: EngineClientConfig) -> Result<Self, EngineError> {
        validate_address(&config.input_address)?;
        validate_address(&config.output_address)?;
        let connection = connect(&config, Instant::now() + config.ready_timeout).await?;
        let ready = connection.ready.clone();

        let (commands_tx, commands_rx) = mpsc::unbounded_channel();
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (health_tx, health_rx) = watch::channel(EngineHealth::Healthy);
        let (stats_tx, stats_rx) = watch::channel(None);
        let restarts = Arc::new(AtomicU64::new(0));
        let utility_timeout = config.utility_timeout;
        let mut actor = Actor {
            frames: mpsc::unbounded_channel().0,
            events: events_tx,
            generation: 0,
            requests: HashMap::new(),
            calls: HashMap::new(),
            next_call_id: 0,
            health: health_tx,
            stats: stats_tx,
            lost_totals: EngineStats::default(),
            restarts: restarts.clone(),
            ready: ready.clone(),
            tasks: Vec::new(),
            config,
        };
        actor.attach(connection);
        tokio::spawn(actor.run(commands_rx, events_rx));

        Ok(EngineClient {
            commands: commands_tx,
            health: health_rx,
            stats: stats_rx,
            restarts,
            ready,
            utility_timeout,
        })
    }

    /// What the engine announced in its first `ready` message.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// Sends the request; its outputs arrive on the returned stream, which ends
    /// after the output carrying a finish reason. Dropping the stream before
    /// then aborts the request in the engine.
    pub fn add_request(&self, request: AddRequest) -> Result<OutputStream, EngineError> {
        match self.health() {
            EngineHealth::Healthy => {}
            EngineHealth::Restarting(reason) => return Err(EngineError::Restarting(reason)),
            EngineHealth::Dead(reason) => return Err(EngineError::Dead(reason)),
        }
        let (outputs_tx, outputs_rx) = mpsc::unbounded_channel();
        let request_id = request.request_id.clone();
        self.send(Command::Add {
            request: Box::new(request),
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

    /// How many times a new engine core took over after one was lost.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
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
    config: EngineClientConfig,
    /// The current connection's writer.
    frames: mpsc::UnboundedSender<Vec<u8>>,
    events: mpsc::UnboundedSender<Tagged>,
    /// The current connection; events tagged with another are stale.
    generation: u64,
    requests: HashMap<String, mpsc::UnboundedSender<EngineOutput>>,
    calls: HashMap<u64, UtilityReply>,
    next_call_id: u64,
    health: watch::Sender<EngineHealth>,
    stats: watch::Sender<Option<EngineStats>>,
    /// The running totals of the engine cores lost so far, added to every successor's stats.
    lost_totals: EngineStats,
    restarts: Arc<AtomicU64>,
    /// The first engine core's `ready`, which every successor must repeat.
    ready: Ready,
    /// The current connection's socket tasks, or the reconnecting task.
    tasks: Vec<JoinHandle<()>>,
}

impl Actor {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut events: mpsc::UnboundedReceiver<Tagged>,
    ) {
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
                Some((generation, event)) = events.recv() => {
                    if generation == self.generation {
                        self.on_event(event);
                    }
                }
            }
        }
        self.stop_tasks();
    }

    /// Why the engine cannot take work now, or None while it is healthy.
    fn unavailable(&self) -> Option<EngineError> {
        match &*self.health.borrow() {
            EngineHealth::Healthy => None,
            EngineHealth::Restarting(reason) => Some(EngineError::Restarting(reason.clone())),
            EngineHealth::Dead(reason) => Some(EngineError::Dead(reason.clone())),
        }
    }

    fn on_command(&mut self, command: Command) {
        let unavailable = self.unavailable();
        match command {
            Command::Add { request, outputs } => {
                if let Some(error) = unavailable {
                    let _ = outputs.send(failed(&request.request_id, &error));
                } else if self.requests.contains_key(&request.request_id) {
                    let _ = outputs.send(EngineOutput::failed(
                        &request.request_id,
                        "request id is already in flight",
                    ));
                } else {
                    self.requests.insert(request.request_id.clone(), outputs);
                    self.send((*request).into());
                }
            }
            Command::Abort(request_ids) => {
                if unavailable.is_none() && !request_ids.is_empty() {
                    self.send(Abort { request_ids }.into());
                }
            }
            Command::Release(request_id) => {
                if self.requests.remove(&request_id).is_some() && unavailable.is_none() {
                    self.send(
                        Abort {
                            request_ids: vec![request_id],
                        }
                        .into(),
                    );
                }
            }
            Command::Utility { method, reply } => match unavailable {
                Some(error) => {
                    let _ = reply.send(Err(error));
                }
                None => self.call(method, reply),
            },
        }
    }

    fn on_event(&mut self, event: Event) {
        if matches!(*self.health.borrow(), EngineHealth::Dead(_)) {
            return;
        }
        let message = match event {
            Event::Message(message) => message,
            Event::Lost(reason) => return self.lose(reason),
            Event::Failed(reason) => return self.die(reason),
            Event::Connected(connection) => return self.resume(connection),
        };
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
                self.publish_stats(step.stats);
            }
            Message::UtilityResult(result) => {
                if let Some(UtilityValue::Stats(stats)) = &result.result {
                    self.publish_stats(stats.clone());
                }
                if let Some(reply) = self.calls.remove(&result.call_id) {
                    let _ = reply.send(match result.error {
                        Some(error) => Err(EngineError::Utility(error)),
                        None => Ok(result.result),
                    });
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

    fn publish_stats(&self, stats: EngineStats) {
        self.stats
            .send_replace(Some(stats.plus_totals_of(&self.lost_totals)));
    }

    /// Starts the socket tasks of `connection` as the current generation.
    fn attach(&mut self, connection: Connection) {
        let Connection {
            push,
            pull,
            monitor,
            ready: _,
        } = connection;
        let (frames_tx, frames_rx) = mpsc::unbounded_channel();
        self.frames = frames_tx;
        let generation = self.generation;
        self.tasks = vec![
            tokio::spawn(write_frames(
                push,
                frames_rx,
                generation,
                self.events.clone(),
            )),
            tokio::spawn(read_frames(pull, monitor, generation, self.events.clone())),
        ];
        // Only the first engine core's pid is known; its successors are watched by their sockets.
        if let (0, Some(pid)) = (generation, self.config.engine_pid) {
            let events = self.events.clone();
            self.tasks.push(tokio::spawn(async move {
                wait_for_process_exit(pid).await;
                let reason = format!("the engine core process {pid} exited");
                let _ = events.send((generation, Event::Lost(reason)));
            }));
        }
    }

    /// The engine core went away: with reconnect, fail what is in flight and await its successor.
    fn lose(&mut self, reason: String) {
        if !self.config.reconnect {
            return self.die(reason);
        }
        let reason = format!("{reason}; it is being restarted");
        eprintln!("sluice-frontend: the engine core was lost: {reason}");
        self.health
            .send_replace(EngineHealth::Restarting(reason.clone()));
        self.fail_in_flight(&EngineError::Restarting(reason));
        // The lost engine core's gauges describe nothing that still exists; its totals carry on.
        // (What was published already holds the totals of the engine cores lost before it.)
        if let Some(last) = self.stats.send_replace(None) {
            self.lost_totals = last;
        }
        self.stop_tasks();
        self.generation += 1;
        let (config, generation, events) =
            (self.config.clone(), self.generation, self.events.clone());
        self.tasks.push(tokio::spawn(async move {
            let connection = reconnect(&config).await;
            let _ = events.send((generation, Event::Connected(connection)));
        }));
    }

    fn resume(&mut self, connection: Connection) {
        let (old, new) = (&self.ready, &connection.ready);
        // The served model and limits were announced once, to every handle; a successor must keep
        // them (its KV blocks may be more or fewer).
        let same_blocks = Ready {
            num_kv_blocks: old.num_kv_blocks,
            ..new.clone()
        };
        if same_blocks != *old {
            return self.die(format!(
                "the restarted engine core announced {new:?}, unlike the first one's {old:?}"
            ));
        }
        self.stop_tasks();
        self.attach(connection);
        self.restarts.fetch_add(1, Ordering::Relaxed);
        self.health.send_replace(EngineHealth::Healthy);
        eprintln!("sluice-frontend: the restarted engine core is ready");
    }

    fn call(&mut self, method: UtilityMethod, reply: UtilityReply) {
        let call_id = self.next_call_id;
        self.next_call_id += 1;
        // Callers that gave up (timed out) leave entries whose replies have nowhere to go.
        self.calls.retain(|_, reply| !reply.is_closed());
        self.calls.insert(call_id, reply);
        self.send(UtilityCall { call_id, method }.into());
    }

    fn send(&mut self, message: Message) {
        // The writer reports its own failure as an event; a send error here means it already has.
        let _ = self.frames.send(protocol::encode(&message));
    }

    /// Every request in flight ends with an error and every call fails: nothing hangs.
    fn die(&mut self, reason: String) {
        if matches!(*self.health.borrow(), EngineHealth::Dead(_)) {
            return;
        }
        // Unhealthy first, so that a request reading its failure already sees why.
        self.health.send_replace(EngineHealth::Dead(reason.clone()));
        self.fail_in_flight(&EngineError::Dead(reason));
        self.stop_tasks();
    }

    fn fail_in_flight(&mut self, error: &EngineError) {
        for (request_id, outputs) in self.requests.drain() {
            let _ = outputs.send(failed(&request_id, error));
        }
        for (_, reply) in self.calls.drain() {
            let _ = reply.send(Err(error.clone()));
        }
    }

    fn stop_tasks(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

fn failed(request_id: &str, error: &EngineError) -> EngineOutput {
    let message = match error {
        EngineError::Dead(reason) => format!("engine core failed: {reason}"),
        other => other.to_string(),
    };
    EngineOutput::failed(request_id, message)
}
