//! `POST /score` (vLLM's) and `POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's shape,
//! as vLLM serves them). For an embedding model, as a bi-encoder: each distinct text one pooling
//! request, fanned out as embeddings' inputs are, and each score the cosine of a pair's embeddings,
//! computed here in f64 from the engine's float32 values. For a cross-encoder: each pair one
//! pooling request (the two texts one prompt), fanned out the same way, and each score the one
//! float32 value the engine answers it with.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::embeddings::{embedding_bytes, float32_values, pooling_usage};
use crate::api::error::ApiError;
use crate::api::fan_out::{self, ResponseHeader};
use crate::api::prepare::{self, Scoring, ValidRerank, ValidScore};
use crate::api::request_fields::with_ignored_fields;
use crate::api::validate::Route;
use crate::state::{AppState, Arrival};
use sluice_common::schema::openai::EmbeddingUsage;
use sluice_common::schema::score::{
    RerankDocument, RerankRequest, RerankResponse, RerankResult, ScoreData, ScoreRequest,
    ScoreResponse,
};

pub async fn score(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ScoreRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Arrival::now();
    prepare::check_route(&state, Route::Scores)?;
    let Json(request) = body?;
    let valid = prepare::score(&state, request).await?;
    let (header, scores) = pair_scores(&state, "score", &valid, arrival).await?;
    let usage = pooling_usage(&valid.request);
    let response = Json(score_response(header, scores, usage)).into_response();
    Ok(with_ignored_fields(response, &valid.request.ignored_fields))
}

pub async fn rerank(
    State(state): State<Arc<AppState>>,
    body: Result<Json<RerankRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Arrival::now();
    prepare::check_route(&state, Route::Scores)?;
    let Json(request) = body?;
    let ValidRerank {
        score,
        top_n,
        documents,
    } = prepare::rerank(&state, request).await?;
    let (header, scores) = pair_scores(&state, "rerank", &score, arrival).await?;
    let usage = pooling_usage(&score.request);
    let response = Json(rerank_response(header, scores, top_n, documents, usage)).into_response();
    Ok(with_ignored_fields(response, &score.request.ignored_fields))
}

/// Runs the request's pooling requests, and answers each pair's score in the pairs' order.
async fn pair_scores(
    state: &AppState,
    id_kind: &str,
    valid: &ValidScore,
    arrival: Arrival,
) -> Result<(ResponseHeader, Vec<f64>), ApiError> {
    let choices = fan_out::start(state, id_kind, &valid.request, arrival)?;
    let header = choices.header.clone();
    let outputs = choices
        .collect()
        .await?
        .into_iter()
        .map(|result| Ok(float32_values(&embedding_bytes(result)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let scores = match &valid.scoring {
        Scoring::Cosines(pairs) => pairs
            .iter()
            .map(|&(a, b)| cosine(&outputs[a], &outputs[b]))
            .collect(),
        Scoring::CrossEncoder => outputs
            .iter()
            .map(|values| cross_encoder_score(values))
            .collect::<Result<_, _>>()?,
    };
    Ok((header, scores))
}

/// A cross-encoder's answer to a pair: exactly one value, its score as the engine computed it.
fn cross_encoder_score(values: &[f64]) -> Result<f64, ApiError> {
    match values {
        [score] => Ok(*score),
        _ => Err(ApiError::Internal(format!(
            "the engine answered a cross-encoder's pair with {} values, not its one score",
            values.len()
        ))),
    }
}

/// The cosine similarity of two embeddings of one size; 0 when either is all zeros (as vLLM's,
/// which divides by at least a tiny epsilon).
fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f64>();
    let norms = (dot(a, a) * dot(b, b)).sqrt();
    if norms == 0.0 {
        0.0
    } else {
        dot(a, b) / norms
    }
}

fn score_response(
    header: ResponseHeader,
    scores: Vec<f64>,
    usage: EmbeddingUsage,
) -> ScoreResponse {
    ScoreResponse {
        id: header.id,
        object: "list".into(),
        created: header.created,
        model: header.model,
        data: (0..)
            .zip(scores)
            .map(|(index, score)| ScoreData {
                index,
                object: "score".into(),
                score,
            })
            .collect(),
        usage,
    }
}

/// Each document's result (with its text, when `documents` are given), the most relevant first
/// (equal scores in the documents' order), cut to `top_n`.
fn rerank_response(
    header: ResponseHeader,
    scores: Vec<f64>,
    top_n: Option<usize>,
    documents: Option<Vec<String>>,
    usage: EmbeddingUsage,
) -> RerankResponse {
    let mut texts = documents.map(Vec::into_iter);
    let mut results: Vec<RerankResult> = (0..)
        .zip(scores)
        .map(|(index, relevance_score)| RerankResult {
            index,
            document: texts
                .as_mut()
                .and_then(Iterator::next)
                .map(|text| RerankDocument { text }),
            relevance_score,
        })
        .collect();
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    results.truncate(top_n.unwrap_or(results.len()));
    RerankResponse {
        id: header.id,
        model: header.model,
        usage,
        results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: &str) -> ResponseHeader {
        ResponseHeader {
            id: format!("{kind}-1"),
            created: 1_700_000_000,
            model: "smol".into(),
        }
    }

    const USAGE: EmbeddingUsage = EmbeddingUsage {
        prompt_tokens: 7,
        total_tokens: 7,
    };

    #[test]
    fn the_cosine_ignores_length_and_is_zero_against_a_zero_vector() {
        assert_eq!(cosine(&[1.0, 0.0], &[3.0, 0.0]), 1.0);
        assert_eq!(cosine(&[1.0, 0.0], &[0.0, 2.0]), 0.0);
        assert_eq!(cosine(&[1.0, 1.0], &[-1.0, -1.0]), -1.0);
        let half = cosine(&[1.0, 0.0], &[1.0, 3f64.sqrt()]);
        assert!((half - 0.5).abs() < 1e-15, "{half}");
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 2.0]), 0.0);
    }

    #[test]
    fn a_cross_encoders_score_is_its_one_value_as_is() {
        assert_eq!(cross_encoder_score(&[0.875]), Ok(0.875));
        for values in [&[][..], &[0.5, 0.25]] {
            assert!(matches!(
                cross_encoder_score(values),
                Err(ApiError::Internal(_))
            ));
        }
    }

    #[test]
    fn the_score_response_is_vllms_shape_in_the_pairs_order() {
        let response = score_response(header("score"), vec![0.25, -0.5], USAGE);
        assert_eq!(
            serde_json::to_value(response).unwrap(),
            serde_json::json!({
                "id": "score-1",
                "object": "list",
                "created": 1_700_000_000,
                "model": "smol",
                "data": [
                    {"index": 0, "object": "score", "score": 0.25},
                    {"index": 1, "object": "score", "score": -0.5},
                ],
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
            })
        );
    }

    #[test]
    fn rerank_results_are_sorted_by_relevance_keep_ties_in_order_and_stop_at_top_n() {
        let scores = vec![0.1, 0.9, 0.5, 0.9];
        let documents: Vec<String> = ["a", "b", "c", "d"].map(String::from).into();
        let all = rerank_response(header("rerank"), scores.clone(), None, None, USAGE);
        let order: Vec<u32> = all.results.iter().map(|result| result.index).collect();
        assert_eq!(order, [1, 3, 2, 0]);
        assert!(all.results.iter().all(|result| result.document.is_none()));
        let best = rerank_response(header("rerank"), scores, Some(2), Some(documents), USAGE);
        assert_eq!(
            serde_json::to_value(best).unwrap(),
            serde_json::json!({
                "id": "rerank-1",
                "model": "smol",
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
                "results": [
                    {"index": 1, "document": {"text": "b"}, "relevance_score": 0.9},
                    {"index": 3, "document": {"text": "d"}, "relevance_score": 0.9},
                ],
            })
        );
        let more_than_there_are =
            rerank_response(header("rerank"), vec![0.3], Some(5), None, USAGE);
        assert_eq!(more_than_there_are.results.len(), 1);
    }
}
