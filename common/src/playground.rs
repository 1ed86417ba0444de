//! The web playground at `/`: a chat page built with npm and esbuild from `frontend/playground/`
//! (its `dist/` is committed) and embedded in the binary, so it is served with no network and no
//! files beside the binary.
//!
//! The page and its assets are the same static bytes for everyone and hold no data, so they are
//! served without the API key: a browser cannot send a bearer token when it loads a page. What the
//! page shows comes from the API calls it makes, and those carry the key the user enters.

use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// One embedded file and the path it is served at.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

static ASSETS: [Asset; 4] = [
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../../frontend/playground/dist/index.html"),
    },
    Asset {
        path: "/playground/playground.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../frontend/playground/dist/playground.js"),
    },
    Asset {
        path: "/playground/playground.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../frontend/playground/dist/playground.css"),
    },
    Asset {
        path: "/playground/licences.txt",
        content_type: "text/plain; charset=utf-8",
        body: include_bytes!("../../frontend/playground/dist/licences.txt"),
    },
];

/// The page may load only its own script and style and talk only to this server: a reply that
/// slipped markup past the markdown renderer still could not run script or send data elsewhere.
const CONTENT_SECURITY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// Whether `path` is one of the playground's, which need no API key.
pub fn is_playground_path(path: &str) -> bool {
    ASSETS.iter().any(|asset| asset.path == path)
}

/// The playground's routes, to merge into the API's router.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS.iter().fold(Router::new(), |router, asset| {
        router.route(asset.path, get(move || async move { serve(asset) }))
    })
}

fn serve(asset: &'static Asset) -> Response {
    (
        [
            (CONTENT_TYPE, asset.content_type),
            // Revalidate each time, so that a new binary's page is never mixed with an old script.
            (CACHE_CONTROL, "no-cache"),
            (CONTENT_SECURITY_POLICY, CONTENT_SECURITY),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (REFERRER_POLICY, "no-referrer"),
        ],
        asset.body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_exactly_the_embedded_script_and_style() {
        let page = std::str::from_utf8(ASSETS[0].body).unwrap();
        for asset in &ASSETS[1..] {
            assert!(
                page.contains(&format!("\"{}\"", asset.path)),
                "{}",
                asset.path
            );
            assert!(!asset.body.is_empty(), "{} is empty", asset.path);
        }
        assert!(is_playground_path("/"));
        assert!(!is_playground_path("/v1/models"));
        assert!(!is_playground_path("/playground/"));
    }
}
