//! The `sluice-router` binary: the router in front of Sluice replicas.
fn main() -> std::process::ExitCode {
    sluice_common::allocator::keep_large_blocks_unpooled();
    sluice_router::cli::main()
}
