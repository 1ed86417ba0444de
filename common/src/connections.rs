//! The HTTP/1 connections, served by hand rather than by `axum::serve`, for the two bounds it
//! cannot set: a header-read timeout (hyper starts it whenever it waits for a request's head, so
//! it also closes a keep-alive connection left idle) and a bounded drain on shutdown, so that a
//! client that sent half its headers can hold neither a connection nor the process forever.
//! The router serves through this too, and both serve TLS through it (`tls`).
//!
//! Request heads are bounded twice. hyper refuses a head past its hard limits with a bare 431 and
//! closes the connection; below those, a head past the served limits is answered by the server's
//! own layer (`head_too_large`), with a 431 in OpenAI's error shape.

use std::future::Future;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::tls::TlsAcceptor;

/// The served bounds on a request's head: headers, and their bytes (names and values).
pub const MAX_HEADERS: usize = 100;
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// hyper's, past which it answers 431 itself; well above the served ones, so that a head over
/// those reaches the server's layer.
const HARD_MAX_HEADERS: usize = 8 * MAX_HEADERS;
const HARD_MAX_HEAD_BYTES: usize = 4 * MAX_HEADER_BYTES;

/// Why `headers` are over the served bounds, or None.
pub fn head_too_large(headers: &HeaderMap) -> Option<String> {
    if headers.len() > MAX_HEADERS {
        return Some(format!(
            "the request has {} headers; at most {MAX_HEADERS} are accepted",
            headers.len()
        ));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    (bytes > MAX_HEADER_BYTES).then(|| {
        format!("the request's headers take {bytes} bytes; at most {MAX_HEADER_BYTES} are accepted")
    })
}

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// From the moment a connection waits for a request's head until the head is complete.
    pub header_read_timeout: Duration,
    /// After the shutdown signal, how long requests in flight may finish before the rest close.
    pub drain_timeout: Duration,
}

/// Serves `app` on `listener` (over TLS with `tls`) until `shutdown` resolves, then stops
/// accepting, lets the requests in flight finish for at most `limits.drain_timeout`, and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()>,
) {
    let (stop, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let (app, stopping) = (app.clone(), stopping.clone());
                    match tls.clone() {
                        None => tokio::spawn(serve_connection(stream, app, limits, stopping)),
                        Some(tls) => tokio::spawn(async move {
                            // The handshake is bounded as a head is: a client that stalls in it
                            // holds nothing for long.
                            let handshake = tokio::time::timeout(
                                limits.header_read_timeout,
                                tls.accept(stream),
                            );
                            if let Ok(Ok(stream)) = handshake.await {
                                serve_connection(stream, app, limits, stopping).await;
                            }
                        }),
                    };
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
        }
    }
    drop(listener);
    drop(stopping);
    let _ = stop.send(true);
    // Each connection task holds a receiver, so `closed` resolves once every connection ended.
    if tokio::time::timeout(limits.drain_timeout, stop.closed())
        .await
        .is_err()
    {
        eprintln!(
            "sluice: {} connection(s) still open after the {:?} drain; closing them",
            stop.receiver_count(),
            limits.drain_timeout
        );
    }
}

async fn serve_connection<S>(
    stream: S,
    app: Router,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(HARD_MAX_HEADERS)
        .max_header_size(HARD_MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = stopping.wait_for(|stop| *stop) => connection.as_mut().graceful_shutdown(),
    }
    // Finishes the request in flight, if any; a half-read head still ends at its timeout.
    let _ = connection.await;
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderName, HeaderValue};

    use super::*;

    fn headers(count: usize, value_len: usize) -> HeaderMap {
        (0..count)
            .map(|i| {
                (
                    HeaderName::try_from(format!("x-h{i}")).unwrap(),
                    HeaderValue::try_from("v".repeat(value_len)).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn heads_within_the_served_bounds_pass() {
        assert_eq!(head_too_large(&headers(MAX_HEADERS, 10)), None);
        assert_eq!(head_too_large(&headers(1, MAX_HEADER_BYTES - 4)), None);
    }

    #[test]
    fn too_many_headers_or_header_bytes_say_which() {
        let why = head_too_large(&headers(MAX_HEADERS + 1, 1)).unwrap();
        assert!(why.contains("101 headers"), "{why}");
        let why = head_too_large(&headers(2, MAX_HEADER_BYTES / 2)).unwrap();
        assert!(why.contains("bytes"), "{why}");
    }
}
