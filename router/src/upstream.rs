//! The HTTP client to the replicas: pooled keep-alive connections, plain HTTP/1.1.

use std::time::Duration;

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::affinity::replica_tag;
use crate::policies::ReplicaId;
use sluice_common::schema::responses::REPLICA_TAG_HEADER;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Headers that belong to one hop, or that the router sets itself (the key, in `Authorization`
/// only, whichever header the client sent it in).
const NOT_FORWARDED: [HeaderName; 10] = [
    header::HOST,
    header::AUTHORIZATION,
    header::CONTENT_LENGTH,
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static(sluice_common::auth::X_API_KEY),
];

pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `Bearer KEY` for the replicas, when the router has an API key.
    authorization: Option<HeaderValue>,
}

impl Upstream {
    pub fn new(api_key: Option<&str>) -> Result<Self, String> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let authorization = api_key
            .map(|key| HeaderValue::from_str(&format!("Bearer {key}")))
            .transpose()
            .map_err(|_| "--api-key must be printable ASCII".to_string())?;
        Ok(Upstream {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .pool_timer(TokioTimer::new())
                .build(connector),
            authorization,
        })
    }

    /// Sends one request to `replica`; the response's body streams as it arrives.
    pub async fn send(
        &self,
        replica: &ReplicaId,
        method: Method,
        path_and_query: &str,
        client_headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, String> {
        let uri: Uri = format!("{replica}{path_and_query}")
            .parse()
            .map_err(|error| format!("bad upstream URI: {error}"))?;
        let mut request = Request::builder()
            .method(method)
            .uri(uri)
            .body(Full::new(body))
            .map_err(|error| error.to_string())?;
        let headers = request.headers_mut();
        for (name, value) in client_headers {
            if !NOT_FORWARDED.contains(name) && name.as_str() != "keep-alive" {
                headers.append(name.clone(), value.clone());
            }
        }
        if let Some(authorization) = &self.authorization {
            headers.insert(header::AUTHORIZATION, authorization.clone());
        }
        // Which replica this is, for the ids of the responses it stores (`affinity`); whatever a
        // client sent in its place is replaced.
        headers.insert(
            REPLICA_TAG_HEADER,
            HeaderValue::from_str(&replica_tag(replica)).expect("hex digits are a header value"),
        );
        self.client
            .request(request)
            .await
            .map_err(|error| describe_client_error(&error))
    }

    /// `GET /health` answered 200 within `timeout`.
    pub async fn health(&self, replica: &ReplicaId, timeout: Duration) -> bool {
        let no_headers = HeaderMap::new();
        let check = self.send(replica, Method::GET, "/health", &no_headers, Bytes::new());
        matches!(tokio::time::timeout(timeout, check).await, Ok(Ok(response)) if response.status().is_success())
    }
}

/// hyper-util's error says "client error (Connect)"; its source says what happened.
fn describe_client_error(error: &hyper_util::client::legacy::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// The response headers passed back to the client: all but hop-by-hop ones and the length, which
/// the router's own framing sets.
pub fn response_headers(upstream: &HeaderMap) -> HeaderMap {
    upstream
        .iter()
        .filter(|(name, _)| !NOT_FORWARDED.contains(name) && name.as_str() != "keep-alive")
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}
