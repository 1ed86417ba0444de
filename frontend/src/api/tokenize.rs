//! vLLM's `POST /tokenize` and `POST /detokenize`.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::Json;

use crate::api::error::ApiError;
use crate::api::openai::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use crate::api::{admission, validate};
use crate::state::AppState;

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let Json(request) = body?;
    Ok(Json(tokenized(&state, request).await?))
}

/// vLLM's /tokenize: a prompt (special tokens added by default), or messages rendered through
/// the chat template (which holds the special tokens already).
async fn tokenized(
    state: &AppState,
    request: TokenizeRequest,
) -> Result<TokenizeResponse, ApiError> {
    if let Some(model) = &request.model {
        validate::check_model(state, model)?;
    }
    let _waiting = admission::admit(state, 1)?;
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            let add_special_tokens = request.add_special_tokens.unwrap_or(true);
            state.pool.encode(prompt, add_special_tokens).await?
        }
        (None, Some(messages)) => {
            let add_generation_prompt = request.add_generation_prompt.unwrap_or(true);
            let text = validate::chat_text(
                state,
                messages,
                add_generation_prompt,
                false,
                Default::default(),
                None,
            )
            .await?;
            let add_special_tokens = request.add_special_tokens.unwrap_or(false);
            state.pool.encode(text, add_special_tokens).await?
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "give exactly one of `prompt` and `messages`".into(),
            ))
        }
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.max_model_len()?,
        tokens,
    })
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
        validate::check_model(state, model)?;
    }
    validate::check_token_ids("tokens", &request.tokens, state.vocab_size)?;
    let _waiting = admission::admit(state, 1)?;
    Ok(DetokenizeResponse {
        prompt: state.pool.decode(request.tokens, true).await?,
    })
}
