//! The HTTP/1 connections, served by hand rather than by `axum::serve`, for the two bounds it
//! cannot set: a header-read timeout (hyper starts it whenever it waits for a request's head, so
//! it also closes a keep-alive connection left idle) and a bounded drain on shutdown, so that a
//! client that sent half its headers can hold neither a connection nor the process forever.
//! The router serves through this too.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// From the moment a connection waits for a request's head until the head is complete.
    pub header_read_timeout: Duration,
    /// After the shutdown signal, how long requests in flight may finish before the rest close.
    pub drain_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, lets the requests
/// in flight finish for at most `limits.drain_timeout`, and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let (stop, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(serve_connection(stream, app.clone(), limits, stopping.clone()));
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

async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = stopping.wait_for(|stop| *stop) => connection.as_mut().graceful_shutdown(),
    }
    // Finishes the request in flight, if any; a half-read head still ends at its timeout.
    let _ = connection.await;
}
