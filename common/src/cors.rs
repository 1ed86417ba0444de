//! Browsers calling the API from pages of other origins (`--allowed-origins`, `--allowed-methods`,
//! `--allowed-headers`). By default no other origin may: the playground is served from the API's own
//! origin and needs nothing. An allowed origin gets CORS headers on its answers and on the preflight
//! (`OPTIONS`) that a browser sends before a request with an `Authorization` header or a JSON body;
//! the preflight is answered before the API key is checked, since a browser sends it without one.
//! Credentials (cookies) are never allowed: the key travels in a header.

use axum::http::{HeaderName, HeaderValue, Method};
pub use tower_http::cors::CorsLayer;
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin};

/// The response headers a page may read besides the safelisted ones.
const EXPOSED: [&str; 2] = ["x-sluice-ignored-fields", "retry-after"];

/// The CORS layer for the three flags' values (comma-separated lists, or `*`), or None when no
/// origin is allowed. Methods and headers default to whatever an allowed page's browser asks for.
pub fn cors_layer(
    origins: Option<&str>,
    methods: Option<&str>,
    headers: Option<&str>,
) -> Result<Option<CorsLayer>, String> {
    let Some(origins) = origins else {
        if methods.is_some() || headers.is_some() {
            return Err(
                "--allowed-methods and --allowed-headers need --allowed-origins: without it no \
                 other origin may call the API"
                    .into(),
            );
        }
        return Ok(None);
    };
    let allow_origin = match list("allowed-origins", origins)? {
        None => AllowOrigin::any(),
        Some(origins) => AllowOrigin::list(
            origins
                .iter()
                .map(|origin| origin_value(origin))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let allow_methods = match methods.map(|m| list("allowed-methods", m)).transpose()? {
        None | Some(None) => AllowMethods::mirror_request(),
        Some(Some(methods)) => AllowMethods::list(
            methods
                .iter()
                .map(|method| {
                    Method::from_bytes(method.to_ascii_uppercase().as_bytes())
                        .map_err(|_| format!("--allowed-methods: {method:?} is not a method"))
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let allow_headers = match headers.map(|h| list("allowed-headers", h)).transpose()? {
        None | Some(None) => AllowHeaders::mirror_request(),
        Some(Some(headers)) => AllowHeaders::list(
            headers
                .iter()
                .map(|name| {
                    HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                        .map_err(|_| format!("--allowed-headers: {name:?} is not a header name"))
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods(allow_methods)
            .allow_headers(allow_headers)
            .expose_headers(EXPOSED.map(HeaderName::from_static)),
    ))
}

/// A flag's comma-separated entries, or None for `*` (any).
fn list(flag: &str, value: &str) -> Result<Option<Vec<String>>, String> {
    let entries: Vec<String> = value
        .split(',')
        .map(|entry| entry.trim().to_owned())
        .collect();
    if entries.iter().any(String::is_empty) {
        return Err(format!("--{flag}: an empty entry in {value:?}"));
    }
    if entries.iter().any(|entry| entry == "*") {
        if entries.len() > 1 {
            return Err(format!("--{flag}: `*` allows all; give it alone"));
        }
        return Ok(None);
    }
    Ok(Some(entries))
}

/// An origin as browsers send it: `scheme://host[:port]`, nothing after.
fn origin_value(origin: &str) -> Result<HeaderValue, String> {
    let bad = || {
        format!(
            "--allowed-origins: {origin:?} is not an origin (scheme://host[:port], such as \
             https://app.example.com)"
        )
    };
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .ok_or_else(bad)?;
    if rest.is_empty() || rest.contains(['/', '?', '#', ' ']) {
        return Err(bad());
    }
    HeaderValue::from_str(origin).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{header, Request, StatusCode};
    use axum::routing::post;
    use axum::Router;
    use tower::ServiceExt;

    fn app(layer: CorsLayer) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(|| async { "ok" }))
            .layer(layer)
    }

    async fn preflight(app: Router, origin: &str) -> (StatusCode, Option<String>) {
        let request = Request::builder()
            .method(Method::OPTIONS)
            .uri("/v1/chat/completions")
            .header(header::ORIGIN, origin)
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(
                header::ACCESS_CONTROL_REQUEST_HEADERS,
                "authorization,content-type",
            )
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        let allowed = response
            .headers()
            .get(header::ACCESS_CONTROL_ALLOW_ORIGIN)
            .map(|value| value.to_str().unwrap().to_owned());
        (response.status(), allowed)
    }

    #[tokio::test]
    async fn only_listed_origins_are_allowed() {
        let layer = cors_layer(
            Some("https://app.example.com, http://127.0.0.1:3000"),
            None,
            None,
        )
        .unwrap()
        .unwrap();
        let (status, allowed) = preflight(app(layer.clone()), "https://app.example.com").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(allowed.as_deref(), Some("https://app.example.com"));
        let (_, allowed) = preflight(app(layer), "https://evil.example.com").await;
        assert_eq!(allowed, None);
        let any = cors_layer(Some("*"), Some("POST"), Some("authorization,content-type"))
            .unwrap()
            .unwrap();
        assert_eq!(
            preflight(app(any), "https://x.example").await.1.as_deref(),
            Some("*")
        );
    }

    #[test]
    fn bad_values_are_refused_naming_the_flag() {
        assert!(cors_layer(None, None, None).unwrap().is_none());
        for (origins, methods, headers, flag) in [
            (Some("app.example.com"), None, None, "--allowed-origins"),
            (
                Some("https://app.example.com/path"),
                None,
                None,
                "--allowed-origins",
            ),
            (Some("*,https://a.example"), None, None, "--allowed-origins"),
            (Some("https://a.example,"), None, None, "--allowed-origins"),
            (Some("*"), Some("PO ST"), None, "--allowed-methods"),
            (Some("*"), None, Some("bad header"), "--allowed-headers"),
            (None, Some("POST"), None, "need --allowed-origins"),
        ] {
            let error = cors_layer(origins, methods, headers).unwrap_err();
            assert!(error.contains(flag), "{error}");
        }
    }
}
