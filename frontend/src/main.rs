//! The `sluice-frontend` binary: one replica's OpenAI-compatible HTTP server.
fn main() -> std::process::ExitCode {
    sluice_common::allocator::keep_large_blocks_unpooled();
    sluice_frontend::cli::main()
}
