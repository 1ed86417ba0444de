//! Admission: the waiting-queue limit (`--max-waiting-requests`).
//!
//! Each engine request (one per choice: prompts x n; one per embeddings input) and each /tokenize
//! or /detokenize call holds one permit while it WAITS: an engine request gives its permit back
//! when its first output arrives (it has been scheduled), a tokenizer call when it is answered.
//! Running requests do not count; the engine's own `max_num_seqs` bounds them. No permit: an
//! immediate 429. A request that needs more permits than exist can never be admitted, so it is a
//! 400 naming the limit, never a 429 that a client would retry forever.

use tokio::sync::OwnedSemaphorePermit;

use crate::api::error::ApiError;
use crate::state::AppState;
use sluice_common::schema::openai::Prompt;

/// Refuses with a 400 naming `param` (`n`, or embeddings' `input`) a request of `engine_requests`
/// choices (prompts x n, or inputs) that could never be admitted.
pub fn check_fits(
    state: &AppState,
    engine_requests: usize,
    param: &'static str,
) -> Result<(), ApiError> {
    let limit = state.config.max_waiting_requests;
    if engine_requests <= limit {
        return Ok(());
    }
    Err(ApiError::InvalidParameter {
        param,
        message: format!(
            "this request asks for {engine_requests} engine requests (prompts x n, or inputs), \
             more than the {limit} this server lets wait at once (--max-waiting-requests); send \
             fewer prompts or inputs, or a smaller n"
        ),
    })
}

/// `count` waiting-queue permits, one per engine request (or tokenizer call), or a 429.
pub fn admit(state: &AppState, count: usize) -> Result<OwnedSemaphorePermit, ApiError> {
    check_fits(state, count, "n")?;
    let count = u32::try_from(count).map_err(|_| ApiError::QueueFull)?;
    state
        .permits
        .clone()
        .try_acquire_many_owned(count)
        .map_err(|_| ApiError::QueueFull)
}

/// How many prompts a completions request (or inputs an embeddings request) carries, before any is
/// tokenized.
pub fn prompt_count(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(_) | Prompt::Tokens(_) => 1,
        Prompt::Texts(texts) => texts.len(),
        Prompt::TokenLists(lists) => lists.len(),
    }
}
