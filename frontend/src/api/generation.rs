//! The handler that completions, chat, Anthropic's messages and OpenAI's responses share: the
//! request refused unless the model generates, prepared, fanned out to the engine, answered whole
//! or streamed. Each endpoint says how it prepares a request and renders its answers
//! ([`GenerationEndpoint`]).

use std::future::Future;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::error::ApiError;
use crate::api::fan_out::{self, ChoiceResult, Choices, ResponseHeader};
use crate::api::request_fields::with_ignored_fields;
use crate::api::valid_request::ValidRequest;
use crate::api::validate::Route;
use crate::api::{beam_search, best_of, prepare};
use crate::state::{AppState, Arrival};
use sluice_common::schema::openai::Usage;

/// What differs between the endpoints that generate.
pub trait GenerationEndpoint {
    /// The request body as the client sends it.
    type Request: DeserializeOwned + Send + 'static;
    /// The whole (not streamed) answer.
    type Answer: Serialize;
    /// What an answer is made of besides the valid request and its choices: a Responses turn's
    /// conversation and store; nothing for the others.
    type Context: Send + 'static;
    /// The prefix of the response id (`chatcmpl`, `cmpl`).
    const ID_PREFIX: &'static str;

    /// The request validated and made complete (`prepare`), and its context.
    fn prepare(
        state: &AppState,
        request: Self::Request,
        headers: &HeaderMap,
    ) -> impl Future<Output = Result<(ValidRequest, Self::Context), ApiError>> + Send;

    /// The first part of the response's id.
    fn id_kind(_context: &Self::Context) -> String {
        Self::ID_PREFIX.to_owned()
    }

    /// The answer from every choice's result, `best_of` already applied, and their usage.
    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
        context: Self::Context,
    ) -> Self::Answer;

    /// The answer as server-sent events.
    fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
        context: Self::Context,
    ) -> impl Future<Output = Result<Response, ApiError>> + Send;
}

pub async fn create<E: GenerationEndpoint>(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<E::Request>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Arrival::now();
    prepare::check_route(&state, Route::Generation)?;
    let Json(request) = body?;
    let (request, context) = E::prepare(&state, request, &headers).await?;
    let prompt_tokens = request.prompt_tokens();
    if let Some(params) = &request.beam_search {
        let id_kind = E::id_kind(&context);
        let (header, results) =
            beam_search::run(&state, &id_kind, &request, params, arrival).await?;
        let usage = fan_out::whole_usage(&results, prompt_tokens, request.n);
        let response = Json(E::whole(header, results, usage, &request, context)).into_response();
        return Ok(with_ignored_fields(response, &request.ignored_fields));
    }
    let choices = fan_out::start(&state, &E::id_kind(&context), &request, arrival)?;
    let response = if request.stream {
        E::stream(choices, prompt_tokens, &request, context).await?
    } else {
        let header = choices.header.clone();
        let results = best_of::select(choices.collect().await?, request.best_of, request.n);
        let usage = fan_out::whole_usage(&results, prompt_tokens, request.n);
        Json(E::whole(header, results, usage, &request, context)).into_response()
    };
    Ok(with_ignored_fields(response, &request.ignored_fields))
}
