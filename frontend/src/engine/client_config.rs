//! Where the engine core is, and how long the client waits for it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::engine::error::EngineError;

#[derive(Debug, Clone)]
pub struct EngineClientConfig {
    pub input_address: String,
    pub output_address: String,
    /// Covers the engine's start-up: binding, loading the model, allocating the KV cache.
    pub ready_timeout: Duration,
    /// The first engine core's process, when it runs on this machine: its exit is noticed even
    /// before its socket closes.
    pub engine_pid: Option<u32>,
    /// After the engine core goes away, wait for the one its supervisor starts in its place on
    /// the same addresses, instead of dying.
    pub reconnect: bool,
    pub utility_timeout: Duration,
}

impl EngineClientConfig {
    pub fn new(input_address: impl Into<String>, output_address: impl Into<String>) -> Self {
        EngineClientConfig {
            input_address: input_address.into(),
            output_address: output_address.into(),
            ready_timeout: Duration::from_secs(600),
            engine_pid: None,
            reconnect: false,
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
