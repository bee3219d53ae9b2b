//! The console's script and style sheet, embedded in the binary from `src/console/assets/`
//! (shipped in the crate package with the rest of `src/`), so that a `cargo install`
//! serves the console with nothing else to install or build.

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Every asset: file name, media type, content.
pub const ASSETS: [(&str, &str, &str); 2] = [
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/console.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("assets/console.css"),
    ),
];

pub async fn serve(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        Some((_, media_type, body)) => (
            [
                (header::CONTENT_TYPE, *media_type),
                (header::CACHE_CONTROL, "max-age=300"),
            ],
            *body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such asset\n").into_response(),
    }
}
