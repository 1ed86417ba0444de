//! How talking to the engine core fails.

use std::time::Duration;

use thiserror::Error;

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
    #[error("the engine core is restarting: {0}")]
    Restarting(String),
    #[error("utility call failed in the engine core: {0}")]
    Utility(String),
    #[error("utility call got no answer within {0:?}")]
    UtilityTimeout(Duration),
}
