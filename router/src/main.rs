//! The `sluice-router` binary: the router in front of Sluice replicas.
fn main() -> std::process::ExitCode {
    sluice_frontend::allocator::keep_large_blocks_unpooled();
    sluice_router::cli::main()
}
