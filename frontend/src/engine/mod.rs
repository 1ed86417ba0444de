//! The seam to the engine core: its messages and the client that speaks them over ZeroMQ.
pub mod client;
pub mod protocol;
