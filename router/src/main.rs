//! The `sluice-router` binary: the router in front of Sluice replicas.
fn main() -> std::process::ExitCode {
    sluice_router::cli::main()
}
