//! The served /openapi.json lists exactly the routes the router serves (but the playground's page,
//! which is no API), each with exactly the methods it answers: a route added without documenting it
//! (or documented and gone) fails here.
//! No engine is needed: every probe is answered before one would be (400 for an empty body, 503).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use sluice_common::playground;
use sluice_frontend::api::routes;
use sluice_frontend::state::{AppState, ServerConfig};
use tower::ServiceExt;

/// Every method a route could be given; HEAD is left out because axum answers it wherever GET is.
const METHODS: [Method; 5] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
];

fn app() -> Router {
    let state = AppState::load(ServerConfig {
        max_waiting_requests: 8,
        ..common::server_config("smol")
    })
    .expect("the default model's tokenizer loads");
    routes::router(Arc::new(state))
}

/// The paths the router holds, read from its Debug form (`RouteId(3): "/health"`, before the
/// fallback router's own): axum has no public listing, and this is the router itself rather than
/// a second list that could drift.
fn router_paths(app: &Router) -> BTreeSet<String> {
    let debug = format!("{app:?}");
    let (routes, _fallback) = debug
        .split_once("fallback_router")
        .expect("a Router's Debug form names its fallback router after its routes");
    let paths: BTreeSet<String> = routes
        .split("): \"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .filter(|path| path.starts_with('/'))
        .map(str::to_owned)
        .collect();
    assert!(
        paths.len() >= 5,
        "no paths found in the router's Debug form: {debug}"
    );
    paths
}

async fn send(app: &Router, method: Method, path: &str) -> (StatusCode, Vec<u8>) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body.to_vec())
}

async fn documented_operations(app: &Router) -> BTreeMap<String, BTreeSet<String>> {
    let (status, body) = send(app, Method::GET, "/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let document: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(document["openapi"], "3.1.0");
    document["paths"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(path, item)| {
            let methods = item
                .as_object()
                .unwrap()
                .keys()
                .map(|m| m.to_uppercase())
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

#[tokio::test]
async fn the_document_lists_every_route_and_nothing_else() {
    let app = app();
    let documented = documented_operations(&app).await;
    let served: BTreeSet<String> = router_paths(&app)
        .into_iter()
        .filter(|path| !playground::is_playground_path(path))
        .collect();
    let documented_paths: BTreeSet<String> = documented.keys().cloned().collect();
    assert_eq!(
        served, documented_paths,
        "router paths vs /openapi.json paths"
    );
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/health",
    ] {
        assert!(served.contains(path), "{path} is not routed");
    }
}

#[tokio::test]
async fn the_document_lists_exactly_the_methods_each_route_answers() {
    let app = app();
    for (path, methods) in documented_operations(&app).await {
        // A path parameter names the served model, so that a 404 can only mean "not routed"; a
        // stored response's id names none, and its 404 says so in its own code.
        let concrete = path.replace("{model}", "smol").replace("{id}", "resp-none");
        for method in METHODS {
            let (status, body) = send(&app, method.clone(), &concrete).await;
            let documented = methods.contains(method.as_str());
            let code = serde_json::from_slice::<Value>(&body)
                .ok()
                .map(|body| body["error"]["code"].clone());
            let unrouted =
                status == StatusCode::NOT_FOUND && code != Some(Value::from("response_not_found"));
            assert!(!unrouted, "{method} {path}");
            assert_eq!(
                status != StatusCode::METHOD_NOT_ALLOWED,
                documented,
                "{method} {path} answered {status}; documented methods: {methods:?}"
            );
        }
    }
}
