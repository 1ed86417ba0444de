//! The `sluice-router` command: flags, startup checks, and the serving loop.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;

use crate::backoff::RetryConfig;
use crate::breaker::BreakerConfig;
use crate::health::HealthConfig;
use crate::health_checker::run_health_checks;
use crate::policies::{build_policy, CacheAwareConfig, PolicyName, ReplicaId};
use crate::replica_url::{parse_dns_target, parse_replica_url};
use crate::replicas::ReplicaSet;
use crate::state::{AppState, Settings};
use crate::upstream::Upstream;
use sluice_common::connections::{self, ConnectionLimits};
use sluice_common::flag_schema;
use sluice_common::server_args::{positive_seconds, ServerArgs};
use sluice_common::tls::TlsAcceptor;

/// Sluice's router: spreads OpenAI requests over Sluice replicas.
#[derive(Parser, Debug)]
#[command(name = "sluice-router", version)]
pub struct Args {
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A replica's base URL, http://HOST:PORT (repeat for each replica).
    #[arg(long = "replica", value_name = "URL")]
    replicas: Vec<String>,
    /// Find replicas as every address NAME resolves to (a headless Service), on PORT.
    #[arg(long, value_name = "NAME:PORT", conflicts_with = "replicas")]
    discover_dns: Option<String>,
    #[arg(long, default_value_t = 5.0)]
    discover_interval_s: f64,
    #[arg(long, value_enum, default_value = "cache-aware")]
    policy: PolicyName,
    /// consistent-hash keys on this header, else on the body's `user`.
    #[arg(long, default_value = "x-session-id")]
    session_header: String,
    /// The model folder (tokenizer.json, chat template): cache-aware's exact KV matching.
    #[arg(long = "model", value_name = "DIR")]
    model_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 8)]
    cache_aware_balance_abs: usize,
    #[arg(long, default_value_t = 1.5)]
    cache_aware_balance_rel: f64,
    /// cache-aware: seconds that a routed prompt's blocks count as held by its replica before the
    /// replica's KV events confirm them (0: confirmed blocks only).
    #[arg(long, default_value_t = 10.0)]
    cache_aware_pending_s: f64,
    #[arg(long, default_value_t = 2.0)]
    health_interval_s: f64,
    /// Consecutive failed health checks that eject a replica.
    #[arg(long, default_value_t = 3)]
    health_failures: u32,
    /// Consecutive passed health checks that readmit it.
    #[arg(long, default_value_t = 2)]
    health_successes: u32,
    /// Consecutive failed requests that open a replica's circuit breaker.
    #[arg(long, default_value_t = 3)]
    breaker_failures: u32,
    /// How long an open breaker keeps requests away before letting a trial through.
    #[arg(long, default_value_t = 5.0)]
    breaker_cooldown_s: f64,
    /// Retries (on other replicas) of a request that failed before its first byte.
    #[arg(long, default_value_t = 2)]
    max_retries: u32,
    /// The first retry's delay; each next one doubles, with jitter.
    #[arg(long, default_value_t = 25)]
    retry_backoff_ms: u64,
    #[command(flatten)]
    server: ServerArgs,
}

/// Exit status for bad flags.
const EXIT_STARTUP: u8 = 2;

/// Where the replicas come from.
enum ReplicaSource {
    Static(Vec<ReplicaId>),
    Dns { name: String, port: u16 },
}

fn non_negative_seconds(flag: &str, value: f64) -> Result<Duration, String> {
    if value == 0.0 {
        Ok(Duration::ZERO)
    } else {
        positive_seconds(flag, value)
            .map_err(|_| format!("--{flag} must be 0 or a positive number of seconds, got {value}"))
    }
}

fn at_least_one(flag: &str, value: u32) -> Result<u32, String> {
    if value == 0 {
        return Err(format!("--{flag} must be at least 1"));
    }
    Ok(value)
}

impl Args {
    fn replica_source(&self) -> Result<ReplicaSource, String> {
        if let Some(target) = &self.discover_dns {
            let (name, port) =
                parse_dns_target(target).map_err(|error| format!("--discover-dns: {error}"))?;
            return Ok(ReplicaSource::Dns { name, port });
        }
        if self.replicas.is_empty() {
            return Err(
                "no replicas: give --replica URL (repeatable) or --discover-dns NAME:PORT".into(),
            );
        }
        let ids = self
            .replicas
            .iter()
            .map(|url| parse_replica_url(url).map_err(|error| format!("--replica: {error}")))
            .collect::<Result<_, _>>()?;
        Ok(ReplicaSource::Static(ids))
    }

    fn state(&self) -> Result<AppState, String> {
        let health = HealthConfig {
            interval: positive_seconds("health-interval-s", self.health_interval_s)?,
            failures_to_eject: at_least_one("health-failures", self.health_failures)?,
            successes_to_readmit: at_least_one("health-successes", self.health_successes)?,
        };
        let breaker = BreakerConfig {
            failures_to_open: at_least_one("breaker-failures", self.breaker_failures)?,
            cooldown: positive_seconds("breaker-cooldown-s", self.breaker_cooldown_s)?,
        };
        let api_key = self.server.api_key()?;
        let cache_aware = CacheAwareConfig {
            model_dir: self.model_dir.clone(),
            api_key: api_key.clone(),
            balance_abs: self.cache_aware_balance_abs,
            balance_rel: self.cache_aware_balance_rel,
            pending_window: non_negative_seconds(
                "cache-aware-pending-s",
                self.cache_aware_pending_s,
            )?,
        };
        let policy = build_policy(self.policy, &cache_aware)
            .map_err(|error| format!("--policy: {error}"))?;
        Ok(AppState {
            settings: Settings {
                api_key: api_key.clone(),
                metrics_without_auth: self.server.metrics_without_auth,
                session_header: self.session_header.to_ascii_lowercase(),
                health,
                retry: RetryConfig {
                    max_retries: self.max_retries,
                    base: Duration::from_millis(self.retry_backoff_ms),
                },
                max_body_bytes: self.server.max_body_bytes,
                body_read_timeout: self.server.body_read_timeout()?,
                models_timeout: Duration::from_secs(5),
                cors: self.server.cors()?,
            },
            replicas: ReplicaSet::new(breaker),
            policy,
            metrics: Default::default(),
            upstream: Upstream::new(api_key.as_deref())?,
        })
    }
}

/// The `sluice-router` binary's main.
pub fn main() -> ExitCode {
    if flag_schema::print_if_asked::<Args>() {
        return ExitCode::SUCCESS;
    }
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // Inside the runtime, so that a policy may start tasks as it is built.
    runtime.block_on(async {
        let setup = args.replica_source().and_then(|source| {
            let limits = args.server.connection_limits()?;
            Ok((source, args.state()?, limits, args.server.tls()?))
        });
        match setup {
            Ok((source, state, limits, tls)) => {
                serve(args, source, Arc::new(state), limits, tls).await
            }
            Err(error) => {
                eprintln!("sluice-router: error: {error}");
                ExitCode::from(EXIT_STARTUP)
            }
        }
    })
}

async fn serve(
    args: Args,
    source: ReplicaSource,
    state: Arc<AppState>,
    limits: ConnectionLimits,
    tls: Option<TlsAcceptor>,
) -> ExitCode {
    match source {
        ReplicaSource::Static(ids) => state.set_replicas(ids),
        ReplicaSource::Dns { name, port } => {
            let interval = match positive_seconds("discover-interval-s", args.discover_interval_s) {
                Ok(interval) => interval,
                Err(error) => {
                    eprintln!("sluice-router: error: {error}");
                    return ExitCode::from(EXIT_STARTUP);
                }
            };
            tokio::spawn(crate::discovery::run_discovery(
                state.clone(),
                name,
                port,
                interval,
            ));
        }
    }
    let listener = match TcpListener::bind((args.host.as_str(), args.port)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!(
                "sluice-router: error: cannot listen on {}:{}: {error}",
                args.host, args.port
            );
            return ExitCode::from(EXIT_STARTUP);
        }
    };
    tokio::spawn(run_health_checks(state.clone()));
    let scheme = if tls.is_some() { "https" } else { "http" };
    eprintln!(
        "sluice-router: listening on {scheme}://{}:{}",
        args.host, args.port
    );
    let app = crate::server::router(state);
    connections::serve(listener, app, limits, tls, shutdown_signal()).await;
    ExitCode::SUCCESS
}

/// Resolves on SIGINT or SIGTERM; axum then stops accepting and drains in-flight requests.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
    eprintln!("sluice-router: shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(argv: &[&str]) -> Args {
        Args::try_parse_from([&["sluice-router"], argv].concat()).unwrap()
    }

    #[test]
    fn no_replica_is_an_error_naming_the_flags() {
        let error = args(&[]).replica_source().err().unwrap();
        assert!(
            error.contains("--replica") && error.contains("--discover-dns"),
            "{error}"
        );
    }

    #[test]
    fn a_bad_replica_url_is_an_error_naming_the_flag_and_the_url() {
        let error = args(&["--replica", "http://a:1", "--replica", "localhost"])
            .replica_source()
            .err()
            .unwrap();
        assert!(
            error.starts_with("--replica: ") && error.contains("`localhost`"),
            "{error}"
        );
    }

    #[test]
    fn a_bad_dns_target_is_an_error_naming_the_flag() {
        let error = args(&["--discover-dns", "replicas"])
            .replica_source()
            .err()
            .unwrap();
        assert!(error.starts_with("--discover-dns: "), "{error}");
    }

    #[test]
    fn replica_list_and_dns_exclude_each_other() {
        assert!(Args::try_parse_from([
            "sluice-router",
            "--replica",
            "http://a:1",
            "--discover-dns",
            "b:1"
        ])
        .is_err());
    }

    #[test]
    fn bad_numbers_are_named() {
        let error = args(&["--replica", "http://a:1", "--health-interval-s", "0"])
            .state()
            .err()
            .unwrap();
        assert!(error.contains("--health-interval-s"), "{error}");
        let error = args(&["--replica", "http://a:1", "--health-failures", "0"])
            .state()
            .err()
            .unwrap();
        assert!(error.contains("--health-failures"), "{error}");
    }
}
