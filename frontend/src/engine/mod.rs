//! The seam to the engine core: its messages (`protocol`) and the client that speaks them over
//! ZeroMQ (`client`, with its `connection`s, settings and errors).
pub mod client;
pub mod client_config;
pub mod connection;
pub mod error;
pub mod protocol;
