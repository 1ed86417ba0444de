//! The `sluice-frontend` binary: one replica's OpenAI-compatible HTTP server.
fn main() -> std::process::ExitCode {
    sluice_frontend::cli::main()
}
