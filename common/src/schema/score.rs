//! vLLM's `/score` and the `/rerank` it serves in Jina's and Cohere's shape: an embedding model's
//! embeddings compared by their cosine, or a cross-encoder's score of each pair read together.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::schema::openai::{EmbeddingUsage, Prompt};
use crate::schema::whole_number;

/// vLLM's score request: one `text_1` against every `text_2`, or the two paired one to one.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct ScoreRequest {
    pub model: String,
    /// One text (or token list), scored against each of text_2's; or as many as text_2 holds.
    /// vLLM's newer name `data_1` is read as it. A cross-encoder takes text only.
    #[serde(alias = "data_1")]
    pub text_1: Prompt,
    /// A text, texts, token ids or token lists: at most 2048 texts with text_1's, none empty. A
    /// cross-encoder takes text only.
    #[serde(alias = "data_2")]
    pub text_2: Prompt,
    /// vLLM's: keep only each text's last N tokens (-1: the last max_model_len). Refused by a
    /// cross-encoder.
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: under `--scheduling-policy priority` a lower value runs earlier; under fcfs only 0.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub priority: Option<i64>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScoreResponse {
    pub id: String,
    /// "list".
    pub object: String,
    pub created: u64,
    pub model: String,
    /// One per pair, in text_2's order.
    pub data: Vec<ScoreData>,
    /// The tokens of the texts embedded, each distinct text once; a cross-encoder's, each pair's.
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScoreData {
    pub index: u32,
    /// "score".
    pub object: String,
    /// The cosine similarity of the pair's embeddings; a cross-encoder's score of the pair.
    pub score: f64,
}

/// The rerank request of Jina's and Cohere's APIs, as vLLM reads it.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct RerankRequest {
    pub model: String,
    pub query: String,
    /// At most 2047 (2048 texts with the query), none empty.
    pub documents: Vec<String>,
    /// The best N documents; 0 or absent: all of them.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub top_n: Option<i64>,
    /// Whether each result carries its document's text (default true, as vLLM's always do).
    pub return_documents: Option<bool>,
    /// vLLM's: keep only each text's last N tokens (-1: the last max_model_len). Refused by a
    /// cross-encoder.
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: under `--scheduling-policy priority` a lower value runs earlier; under fcfs only 0.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub priority: Option<i64>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RerankResponse {
    pub id: String,
    pub model: String,
    /// The tokens of the query and the documents embedded, each distinct text once; a
    /// cross-encoder's, each pair's.
    pub usage: EmbeddingUsage,
    /// The most relevant first, at most top_n.
    pub results: Vec<RerankResult>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RerankResult {
    /// The document's index in the request.
    pub index: u32,
    /// Absent with `return_documents: false`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
    /// The cosine similarity of the query's and the document's embeddings; a cross-encoder's
    /// score of the two read together.
    pub relevance_score: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RerankDocument {
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_request_reads_text_or_data_names_and_collects_the_rest() {
        let body = r#"{"model":"m","text_1":"q","text_2":["a","b"],"truncate_prompt_tokens":-1,
            "priority":1.0,"queries":["x"]}"#;
        let request: ScoreRequest = serde_json::from_str(body).unwrap();
        assert_eq!(request.text_1, Prompt::Text("q".into()));
        assert_eq!(request.text_2, Prompt::Texts(vec!["a".into(), "b".into()]));
        assert_eq!(
            (request.truncate_prompt_tokens, request.priority),
            (Some(-1), Some(1))
        );
        assert_eq!(request.other_fields.keys().collect::<Vec<_>>(), ["queries"]);
        let aliased: ScoreRequest =
            serde_json::from_str(r#"{"model":"m","data_1":[[1,2]],"data_2":[3]}"#).unwrap();
        assert_eq!(aliased.text_1, Prompt::TokenLists(vec![vec![1, 2]]));
        assert_eq!(aliased.text_2, Prompt::Tokens(vec![3]));
        assert!(aliased.other_fields.is_empty());
        assert!(serde_json::from_str::<ScoreRequest>(r#"{"model":"m","text_1":"q"}"#).is_err());
    }

    #[test]
    fn rerank_request_reads_jinas_fields() {
        let body = r#"{"model":"m","query":"q","documents":["a"],"top_n":2,
            "return_documents":false,"rank_fields":["text"]}"#;
        let request: RerankRequest = serde_json::from_str(body).unwrap();
        assert_eq!(request.documents, ["a"]);
        assert_eq!(
            (request.top_n, request.return_documents),
            (Some(2), Some(false))
        );
        assert_eq!(
            request.other_fields.keys().collect::<Vec<_>>(),
            ["rank_fields"]
        );
        assert!(serde_json::from_str::<RerankRequest>(r#"{"model":"m","query":"q"}"#).is_err());
    }

    #[test]
    fn a_result_without_its_document_leaves_the_field_out() {
        let result = RerankResult {
            index: 2,
            document: None,
            relevance_score: 0.5,
        };
        assert_eq!(
            serde_json::to_value(result).unwrap(),
            serde_json::json!({"index": 2, "relevance_score": 0.5})
        );
    }
}
