//! The settings that the frontend and the router both take as an HTTP server: the API key, the
//! body limit, the slow-client timeouts, the drain on shutdown, the origins allowed (CORS) and HTTPS. Both
//! binaries flatten this one clap struct, so each setting, its help and its default are declared
//! once, and `sluice serve` forwards it to every process that declares it (`flag_schema`).

use std::path::PathBuf;
use std::time::Duration;

use crate::auth::load_api_key;
use crate::connections::ConnectionLimits;
use crate::cors::cors_layer;
use crate::tls::{tls_acceptor, TlsAcceptor};
use tower_http::cors::CorsLayer;

#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// Require `Authorization: Bearer KEY` on every route but /health (the router sends it on to
    /// the replicas). Prefer SLUICE_API_KEY or --api-key-file: a command line is visible to every
    /// user of the machine.
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file holding the API key (one trailing newline is ignored).
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Serve /metrics without the API key.
    #[arg(long)]
    pub metrics_without_auth: bool,
    /// The largest request body (413 beyond it).
    #[arg(long, default_value_t = 8_388_608)]
    pub max_body_bytes: usize,
    /// Seconds a client may take to send a request's headers; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout_s: f64,
    /// Seconds a client may take to send a request's body; slower ones get a 408, so that a client
    /// that sends half a body cannot hold a connection and its buffer.
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout_s: f64,
    /// Seconds requests in flight get to finish after SIGINT or SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout_s: f64,
    /// Origins whose pages may call the API from a browser (CORS): a comma-separated list such as
    /// https://app.example.com, or * for any. Default: none (the playground, on this origin, needs none).
    #[arg(long)]
    pub allowed_origins: Option<String>,
    /// Methods an allowed origin may use, comma-separated, or *. Default: what its browser asks for.
    #[arg(long)]
    pub allowed_methods: Option<String>,
    /// Request headers an allowed origin may send, comma-separated, or *. Default: what its browser
    /// asks for.
    #[arg(long)]
    pub allowed_headers: Option<String>,
    /// Serve HTTPS with this PEM certificate chain (with --ssl-keyfile).
    #[arg(long)]
    pub ssl_certfile: Option<PathBuf>,
    /// The PEM private key of --ssl-certfile.
    #[arg(long)]
    pub ssl_keyfile: Option<PathBuf>,
}

impl ServerArgs {
    /// The key to require, from the flag, SLUICE_API_KEY or the file.
    pub fn api_key(&self) -> Result<Option<String>, String> {
        load_api_key(self.api_key.clone(), self.api_key_file.as_deref())
    }

    pub fn connection_limits(&self) -> Result<ConnectionLimits, String> {
        Ok(ConnectionLimits {
            header_read_timeout: positive_seconds(
                "header-read-timeout-s",
                self.header_read_timeout_s,
            )?,
            drain_timeout: positive_seconds("drain-timeout-s", self.drain_timeout_s)?,
        })
    }

    /// The CORS layer for `--allowed-origins` and its companions, or None when no origin is allowed.
    pub fn cors(&self) -> Result<Option<CorsLayer>, String> {
        cors_layer(
            self.allowed_origins.as_deref(),
            self.allowed_methods.as_deref(),
            self.allowed_headers.as_deref(),
        )
    }

    /// The TLS acceptor of `--ssl-certfile` and `--ssl-keyfile`, or None to serve plain HTTP.
    pub fn tls(&self) -> Result<Option<TlsAcceptor>, String> {
        tls_acceptor(self.ssl_certfile.as_deref(), self.ssl_keyfile.as_deref())
    }

    pub fn body_read_timeout(&self) -> Result<Duration, String> {
        positive_seconds("body-read-timeout-s", self.body_read_timeout_s)
    }
}

/// `value` seconds, which `--flag` requires to be positive and finite.
pub fn positive_seconds(flag: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && value > 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "--{flag} must be a positive number of seconds, got {value}"
        ))
    }
}
