//! Sluice's frontend: everything that touches text and HTTP.
