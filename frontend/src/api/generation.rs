//! The handler that chat and completions share: the request prepared, fanned out to the engine,
//! answered whole or streamed. Each endpoint says how it prepares a request and renders its
//! answers ([`GenerationEndpoint`]).

use std::future::Future;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::best_of;
use crate::api::error::ApiError;
use crate::api::fan_out::{self, ChoiceResult, Choices, ResponseHeader};
use crate::api::request_fields::with_ignored_fields;
use crate::api::valid_request::ValidRequest;
use crate::state::{AppState, Arrival};
use sluice_common::schema::openai::Usage;

/// What differs between `/v1/chat/completions` and `/v1/completions`.
pub trait GenerationEndpoint {
    /// The request body as the client sends it.
    type Request: DeserializeOwned + Send + 'static;
    /// The whole (not streamed) answer.
    type Answer: Serialize;
    /// The prefix of the response id (`chatcmpl`, `cmpl`).
    const ID_PREFIX: &'static str;

    /// The request validated and made complete (`prepare`).
    fn prepare(
        state: &AppState,
        request: Self::Request,
    ) -> impl Future<Output = Result<ValidRequest, ApiError>> + Send;

    /// The answer from every choice's result, `best_of` already applied, and their usage.
    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
    ) -> Self::Answer;

    /// The answer as server-sent events.
    fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
    ) -> impl Future<Output = Result<Response, ApiError>> + Send;
}

pub async fn create<E: GenerationEndpoint>(
    State(state): State<Arc<AppState>>,
    body: Result<Json<E::Request>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Arrival::now();
    let Json(request) = body?;
    let request = E::prepare(&state, request).await?;
    let choices = fan_out::start(&state, E::ID_PREFIX, &request, arrival)?;
    let prompt_tokens = request.prompt_tokens();
    let response = if request.stream {
        E::stream(choices, prompt_tokens, &request).await?
    } else {
        let header = choices.header.clone();
        let results = best_of::select(choices.collect().await?, request.best_of, request.n);
        let usage = fan_out::whole_usage(&results, prompt_tokens, request.n);
        Json(E::whole(header, results, usage, &request)).into_response()
    };
    Ok(with_ignored_fields(response, &request.ignored_fields))
}
