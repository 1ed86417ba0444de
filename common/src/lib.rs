//! What Sluice's frontend and router both use, so that the router depends on this crate and not on
//! the frontend: the OpenAI schema (`schema`), tokenizer loading, the chat template and the piecewise
//! encoder (`text`), the API key check (`auth`), Anthropic's error shape on its routes (`error_dialect`), browsers on other origins (`cors`), HTTPS (`tls`), HTTP/1 connections with their limits
//! (`connections`), the settings of an HTTP server (`server_args`) and their schema for `sluice serve`
//! (`flag_schema`), the allocator setting (`allocator`) and the playground's page (`playground`).
pub mod allocator;
pub mod auth;
pub mod connections;
pub mod cors;
pub mod error_dialect;
pub mod flag_schema;
pub mod playground;
pub mod schema;
pub mod server_args;
pub mod text;
pub mod tls;
