//! `POST /v1/embeddings` (OpenAI's, with vLLM's extensions): each input a pooling request of its
//! own, fanned out as completions' prompts are, answered with their embeddings in the inputs' order.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::error::ApiError;
use crate::api::fan_out::{self, ChoiceResult};
use crate::api::prepare;
use crate::api::request_fields::with_ignored_fields;
use crate::api::valid_request::ValidRequest;
use crate::api::validate::{EncodingFormat, Route};
use crate::state::{AppState, Arrival};
use sluice_common::schema::openai::{
    Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, EmbeddingVector,
};

/// The prefix of the engine requests' ids.
const ID_PREFIX: &str = "embd";

pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Json<EmbeddingRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Arrival::now();
    prepare::check_route(&state, Route::Embeddings)?;
    let Json(request) = body?;
    let (request, format) = prepare::embeddings(&state, request).await?;
    let results = fan_out::start(&state, ID_PREFIX, &request, arrival)?
        .collect()
        .await?;
    let response = Json(embedding_response(&request, results, format)?).into_response();
    Ok(with_ignored_fields(response, &request.ignored_fields))
}

fn embedding_response(
    request: &ValidRequest,
    results: Vec<ChoiceResult>,
    format: EncodingFormat,
) -> Result<EmbeddingResponse, ApiError> {
    let data = (0..)
        .zip(results)
        .map(|(index, result)| {
            Ok(Embedding {
                object: "embedding".into(),
                index,
                embedding: embedding_vector(embedding_bytes(result)?, format),
            })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(EmbeddingResponse {
        object: "list".into(),
        data,
        model: request.model.clone(),
        usage: pooling_usage(request),
    })
}

/// A pooling request's usage: its prompts' tokens, which are all it takes.
pub(crate) fn pooling_usage(request: &ValidRequest) -> EmbeddingUsage {
    let prompt_tokens = request.prompt_tokens();
    EmbeddingUsage {
        prompt_tokens,
        total_tokens: prompt_tokens,
    }
}

/// A pooling request's embedding: the engine's little-endian float32 bytes, whole values.
pub(crate) fn embedding_bytes(result: ChoiceResult) -> Result<Vec<u8>, ApiError> {
    let bytes = result.embedding.ok_or_else(|| {
        ApiError::Internal("the engine answered a pooling request with no embedding".into())
    })?;
    if !bytes.len().is_multiple_of(4) {
        return Err(ApiError::Internal(format!(
            "the engine's embedding has {} bytes, which are not whole float32 values",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Whole little-endian float32 values, each widened to the float64 it is exactly.
pub(crate) fn float32_values(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(4)
        .map(|value| {
            let value = value.try_into().expect("chunks of four bytes");
            f64::from(f32::from_le_bytes(value))
        })
        .collect()
}

/// The engine's bytes as `format` writes them: base64 is those very bytes.
fn embedding_vector(bytes: Vec<u8>, format: EncodingFormat) -> EmbeddingVector {
    match format {
        EncodingFormat::Base64 => EmbeddingVector::Base64(base64::encode(bytes)),
        EncodingFormat::Float => EmbeddingVector::Floats(float32_values(&bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::valid_request::ValidPrompt;
    use crate::engine::protocol::SamplingParams;

    fn bytes_of(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| value.to_le_bytes())
            .collect()
    }

    #[test]
    fn floats_are_the_float32_values_exactly() {
        let values = [0.1f32, -1.5, f32::MIN_POSITIVE, 3.4e38];
        let EmbeddingVector::Floats(floats) =
            embedding_vector(bytes_of(&values), EncodingFormat::Float)
        else {
            panic!("not floats");
        };
        assert_eq!(floats.len(), values.len());
        for (float, value) in floats.iter().zip(values) {
            assert_eq!(*float as f32, value);
            assert_eq!(*float, f64::from(value));
        }
        // Written as float64, 0.1f32 reads back as itself: 0.10000000149011612, not 0.1.
        let json = serde_json::to_string(&floats[0]).unwrap();
        assert_eq!(json.parse::<f64>().unwrap(), f64::from(0.1f32));
    }

    #[test]
    fn base64_is_the_engines_bytes() {
        // 1.0 and -2.0 as little-endian float32: 00 00 80 3f, 00 00 00 c0.
        let bytes = bytes_of(&[1.0, -2.0]);
        assert_eq!(bytes, [0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0]);
        assert_eq!(
            embedding_vector(bytes, EncodingFormat::Base64),
            EmbeddingVector::Base64("AACAPwAAAMA=".into())
        );
    }

    #[test]
    fn a_partial_float_is_an_internal_error() {
        let partial = ChoiceResult {
            embedding: Some(vec![0, 0, 128]),
            ..ChoiceResult::default()
        };
        assert!(matches!(
            embedding_bytes(partial),
            Err(ApiError::Internal(_))
        ));
    }

    #[test]
    fn the_response_lists_each_input_in_order_with_the_prompt_tokens() {
        let request = ValidRequest {
            model: "smol".into(),
            prompts: vec![
                ValidPrompt {
                    token_ids: vec![1, 2, 3],
                    echo: None,
                    params: SamplingParams::default(),
                    second_text_start: None,
                };
                2
            ],
            ..ValidRequest::default()
        };
        let result = |value: f32| ChoiceResult {
            embedding: Some(bytes_of(&[value])),
            ..ChoiceResult::default()
        };
        let response = embedding_response(
            &request,
            vec![result(0.5), result(-0.25)],
            EncodingFormat::Float,
        )
        .unwrap();
        assert_eq!(
            serde_json::to_value(response).unwrap(),
            serde_json::json!({
                "object": "list",
                "data": [
                    {"object": "embedding", "index": 0, "embedding": [0.5]},
                    {"object": "embedding", "index": 1, "embedding": [-0.25]},
                ],
                "model": "smol",
                "usage": {"prompt_tokens": 6, "total_tokens": 6},
            })
        );
        let missing = embedding_response(
            &request,
            vec![ChoiceResult::default()],
            EncodingFormat::Float,
        );
        assert!(matches!(missing, Err(ApiError::Internal(_))));
    }
}
