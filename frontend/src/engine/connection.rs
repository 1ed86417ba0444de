//! The sockets of one engine core: connecting until it is ready, the tasks that write and read
//! frames, and the signs that it went away (its socket disconnecting, its process exiting).

use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use zeromq::{
    PullSocket, PushSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage,
};

use crate::engine::client_config::EngineClientConfig;
use crate::engine::error::EngineError;
use crate::engine::protocol::{self, Message, Ready};

/// How long one connection attempt may take: zeromq's own retries back off up to 30 s, far
/// longer than an engine core takes to come back, so the client retries by itself instead.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(500);
const CONNECT_RETRY: Duration = Duration::from_millis(50);
const PROCESS_POLL: Duration = Duration::from_millis(100);

type Monitor = futures::channel::mpsc::Receiver<SocketEvent>;

pub(crate) enum Event {
    Message(Message),
    /// The engine core went away: its process exited or its socket closed.
    Lost(String),
    /// The engine core broke the protocol: there is nothing to reconnect to.
    Failed(String),
    /// A new engine core is connected and ready (reconnect only).
    Connected(Connection),
}

/// Events are tagged with the connection they come from, so that a late event of a lost
/// connection never touches its successor.
pub(crate) type Tagged = (u64, Event);

/// Both sockets of one engine core, after its `ready`.
pub(crate) struct Connection {
    pub(crate) push: PushSocket,
    pub(crate) pull: PullSocket,
    pub(crate) monitor: Monitor,
    pub(crate) ready: Ready,
}

/// Both sockets connected and the engine core's `ready` received, by `deadline`.
pub(crate) async fn connect(
    config: &EngineClientConfig,
    deadline: Instant,
) -> Result<Connection, EngineError> {
    let (push, _) = connected::<PushSocket>(&config.input_address, deadline).await?;
    let (mut pull, mut monitor) = connected::<PullSocket>(&config.output_address, deadline).await?;
    let timeout = config.ready_timeout;
    let message = tokio::select! {
        message = next_message(&mut pull) => message?,
        () = disconnection(&mut monitor) => {
            return Err(EngineError::Dead("the engine core went away before it was ready".into()))
        }
        () = tokio::time::sleep_until(deadline) => return Err(EngineError::ReadyTimeout(timeout)),
    };
    match message {
        Message::Ready(ready) => Ok(Connection {
            push,
            pull,
            monitor,
            ready,
        }),
        other => Err(EngineError::Protocol(format!(
            "expected ready, got {}",
            other.type_name()
        ))),
    }
}

/// A socket connected to `address`, with its monitor (made first, so that no event is missed).
async fn connected<S: Socket>(
    address: &str,
    deadline: Instant,
) -> Result<(S, Monitor), EngineError> {
    loop {
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_ATTEMPT);
        let mut socket = S::with_options(options);
        let monitor = socket.monitor();
        match socket.connect(address).await {
            Ok(()) => return Ok((socket, monitor)),
            Err(err) if Instant::now() >= deadline => {
                return Err(EngineError::Connect {
                    address: address.to_owned(),
                    reason: err.to_string(),
                })
            }
            // The engine core binds its sockets early but may still be starting Python.
            Err(_) => tokio::time::sleep(CONNECT_RETRY).await,
        }
    }
}

/// Connects until an engine core is ready on the configured addresses; the supervisor that
/// restarts it decides when to give up.
pub(crate) async fn reconnect(config: &EngineClientConfig) -> Connection {
    loop {
        match connect(config, Instant::now() + config.ready_timeout).await {
            Ok(connection) => return connection,
            Err(error) => {
                eprintln!("sluice-frontend: waiting for the restarted engine core: {error}");
                tokio::time::sleep(CONNECT_RETRY).await;
            }
        }
    }
}

/// Resolves once the peer disconnects; never if the monitor closes first.
async fn disconnection(monitor: &mut Monitor) {
    while let Some(event) = monitor.next().await {
        if matches!(event, SocketEvent::Disconnected(_)) {
            return;
        }
    }
    std::future::pending::<()>().await;
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

pub(crate) async fn write_frames(
    mut push: PushSocket,
    mut frames: mpsc::UnboundedReceiver<Vec<u8>>,
    generation: u64,
    events: mpsc::UnboundedSender<Tagged>,
) {
    while let Some(frame) = frames.recv().await {
        if let Err(err) = push.send(ZmqMessage::from(frame)).await {
            let _ = events.send((generation, Event::Lost(format!("input socket: {err}"))));
            return;
        }
    }
}

pub(crate) async fn read_frames(
    mut pull: PullSocket,
    mut monitor: Monitor,
    generation: u64,
    events: mpsc::UnboundedSender<Tagged>,
) {
    loop {
        let event = tokio::select! {
            frame = pull.recv() => match frame {
                Ok(frame) => match decode_frame(frame) {
                    Ok(message) => Event::Message(message),
                    // The spec: a frame the frontend cannot read is an engine failure.
                    Err(reason) => Event::Failed(format!("undecodable frame: {reason}")),
                },
                Err(err) => Event::Lost(format!("output socket: {err}")),
            },
            // The fair queue reports the peer's EOF only after its last frame was
            // returned, so no output is lost by stopping here.
            () = disconnection(&mut monitor) => Event::Lost("engine core disconnected".into()),
        };
        let last = matches!(event, Event::Failed(_) | Event::Lost(_));
        if events.send((generation, event)).is_err() || last {
            return;
        }
    }
}

/// Resolves once process `pid` has exited: gone from /proc, or a zombie its parent has not reaped.
pub(crate) async fn wait_for_process_exit(pid: u32) {
    let stat = PathBuf::from(format!("/proc/{pid}/stat"));
    loop {
        match std::fs::read_to_string(&stat) {
            Ok(text) if !process_state_is_zombie(&text) => {}
            _ => return,
        }
        tokio::time::sleep(PROCESS_POLL).await;
    }
}

/// The state field of /proc/PID/stat follows the parenthesised command name, which may contain spaces.
fn process_state_is_zombie(stat: &str) -> bool {
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state == "Z" || state == "X")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zombie_state_is_read_after_the_command_name() {
        assert!(!process_state_is_zombie("42 (python3) S 1 42 42"));
        assert!(process_state_is_zombie("42 (python3) Z 1 42 42"));
        assert!(!process_state_is_zombie("42 (a) Z (b) S 1 2 3"));
        assert!(!process_state_is_zombie("garbage"));
    }
}
