//! Sluice's frontend: everything that touches text and HTTP.
pub mod metrics;
pub mod openai;
