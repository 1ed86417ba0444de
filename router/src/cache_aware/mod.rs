//! Cache-aware routing: the replica most likely to hold a prompt's prefix, within a load bound.
