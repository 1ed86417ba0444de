//! vLLM's `POST /tokenize` and `POST /detokenize`.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::error::ApiError;
use crate::api::request_fields::with_ignored_fields;
use crate::api::{admission, prepare, validate};
use crate::state::AppState;
use sluice_common::schema::openai::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    // Validated first, as generation is: a request that can never succeed is a 400, not a 429.
    let valid = prepare::tokenize(&state, request).await?;
    let _waiting = admission::admit(&state, 1)?;
    let tokens = state
        .pool
        .encode(valid.text, valid.add_special_tokens)
        .await?;
    // vLLM's token_strs: the vocabulary's strings (byte-level symbols, as the tokenizer has them).
    let token_strs = valid.return_token_strs.then(|| {
        let tokenizer = state.pool.tokenizer();
        tokens
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    let response = TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.max_model_len()?,
        tokens,
        token_strs,
    };
    Ok(with_ignored_fields(
        Json(response).into_response(),
        &valid.ignored_fields,
    ))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let Json(request) = body?;
    Ok(Json(detokenized(&state, request).await?))
}

async fn detokenized(
    state: &AppState,
    request: DetokenizeRequest,
) -> Result<DetokenizeResponse, ApiError> {
    if let Some(model) = &request.model {
        prepare::check_model(state, model)?;
    }
    validate::check_token_ids("tokens", &request.tokens, state.vocab_size)?;
    let _waiting = admission::admit(state, 1)?;
    Ok(DetokenizeResponse {
        prompt: state.pool.decode(request.tokens, true).await?,
    })
}
