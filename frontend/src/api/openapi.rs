//! The OpenAPI 3.1 document served at `GET /openapi.json`.
//!
//! The schemas are derived from the wire types themselves (`utoipa::ToSchema` on `openai.rs`, the
//! error body and the KV-cache snapshot), so a field cannot change without the document changing.
//! [`ROUTES`] names every route with the statuses its handler answers; `tests/openapi_routes.rs`
//! checks that the router serves exactly the routes and methods the document lists.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{
    Content, OpenApi as Document, Paths, Ref, Required, ResponseBuilder, Responses,
};
use utoipa::OpenApi;

use crate::api::error::ErrorResponse;
use crate::engine::protocol::{BlockPoolAudit, KvCacheSnapshot};
use sluice_common::error_dialect::is_anthropic_path;
use sluice_common::schema::anthropic::{
    CountTokensRequest, CountTokensResponse, ErrorResponse as AnthropicErrorResponse,
    MessagesRequest, MessagesResponse,
};
use sluice_common::schema::openai::{
    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
    CompletionResponse, DetokenizeRequest, DetokenizeResponse, EmbeddingRequest, EmbeddingResponse,
    ModelList, TokenizeRequest, TokenizeResponse,
};
use sluice_common::schema::responses::{
    DeletedResponse, InputItemList, ResponseObject, ResponsesRequest,
};
use sluice_common::schema::score::{RerankRequest, RerankResponse, ScoreRequest, ScoreResponse};

/// The component schemas; every schema these reference is collected with them.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Sluice",
        description = "An OpenAI-compatible inference server: completions, chat completions, \
                       OpenAI's responses (stored conversations), embeddings, score and rerank (of \
                       a pooling model), models, vLLM's tokenize and detokenize, Anthropic's \
                       messages and count_tokens, health, version, Prometheus metrics."
    ),
    components(schemas(
        CompletionRequest,
        CompletionResponse,
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionChunk,
        ModelList,
        TokenizeRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse,
        KvCacheSnapshot,
        BlockPoolAudit,
        ErrorResponse,
        MessagesRequest,
        MessagesResponse,
        CountTokensRequest,
        CountTokensResponse,
        AnthropicErrorResponse,
        ResponsesRequest,
        ResponseObject,
        DeletedResponse,
        InputItemList,
        EmbeddingRequest,
        EmbeddingResponse,
        ScoreRequest,
        ScoreResponse,
        RerankRequest,
        RerankResponse,
    ))
)]
struct Components;

/// What a route answers with its 200.
enum Success {
    /// JSON of the named component schema.
    Json(&'static str),
    /// JSON of the first schema, or (with `"stream": true`) server-sent events of the second.
    JsonOrEvents(&'static str, &'static str),
    /// JSON of the schema, or (with `"stream": true`) named server-sent events (`event:` and
    /// `data:`), as the description says (Anthropic's and the Responses API's).
    JsonOrNamedEvents(&'static str, &'static str),
    /// `{"version": "...", "cpu_kernels": "..."}`.
    Version,
    /// The Prometheus text exposition format.
    Prometheus,
    /// This document.
    Document,
    /// No body: the status is the answer.
    Empty,
}

struct Route {
    method: HttpMethod,
    path: &'static str,
    summary: &'static str,
    /// The component schema of the JSON body, for routes that take one.
    request: Option<&'static str>,
    success: Success,
    /// Every error status the handler can answer, each with an [`ErrorResponse`] body.
    errors: &'static [u16],
}

/// A generation request's errors: bad input, a key, an unknown model, a body too large, a full
/// waiting queue, a failure inside, an engine that is down.
const GENERATION_ERRORS: &[u16] = &[400, 404, 413, 429, 500, 503];
const TOKENIZER_ERRORS: &[u16] = &[400, 404, 413, 429, 500, 503];

/// `/rerank`, `/v1/rerank` and `/v2/rerank` are one handler.
const RERANK_SUMMARY: &str = "Documents ordered by relevance to the query (Jina's and Cohere's \
                              rerank, as vLLM serves it for a pooling model): for an embedding \
                              model the cosine similarity of their embeddings with the query's, for \
                              a cross-encoder its score of each query and document read together";

const ROUTES: &[Route] = &[
    Route {
        method: HttpMethod::Post,
        path: "/v1/completions",
        summary: "Complete one or more prompts (OpenAI's completions, with vLLM's sampling fields)",
        request: Some("CompletionRequest"),
        success: Success::JsonOrEvents("CompletionResponse", "CompletionResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/chat/completions",
        summary: "Answer a conversation rendered through the model's chat template",
        request: Some("ChatCompletionRequest"),
        success: Success::JsonOrEvents("ChatCompletionResponse", "ChatCompletionChunk"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/messages",
        summary: "Answer a conversation in Anthropic's Messages API (served as a chat request)",
        request: Some("MessagesRequest"),
        success: Success::JsonOrNamedEvents(
            "MessagesResponse",
            "The event as JSON: message_start, ping, then per content block \
             content_block_start, content_block_delta (text_delta, thinking_delta or \
             input_json_delta) and content_block_stop, then message_delta and message_stop; a \
             failure mid-stream is an `error` event",
        ),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/messages/count_tokens",
        summary: "The prompt tokens of a Messages request with this conversation (Anthropic's)",
        request: Some("CountTokensRequest"),
        success: Success::Json("CountTokensResponse"),
        errors: TOKENIZER_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/responses",
        summary: "Answer a turn in OpenAI's Responses API (served as a chat request), stored for \
                  previous_response_id follow-ups unless `store` is false",
        request: Some("ResponsesRequest"),
        success: Success::JsonOrNamedEvents(
            "ResponseObject",
            "The event as JSON with its sequence_number: response.created, \
             response.in_progress, then per output item response.output_item.added, its deltas \
             (response.content_part.added and response.output_text.delta or \
             response.reasoning_text.delta, or response.function_call_arguments.delta), their \
             .done events and response.output_item.done; then response.completed, or \
             response.incomplete when max_output_tokens cut the answer; a failure mid-stream is \
             an `error` event",
        ),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/embeddings",
        summary: "Embed one or more inputs (OpenAI's embeddings, with vLLM's fields); a server of \
                  a generative model or of a cross-encoder answers 400, as a pooling model's \
                  answers generation routes",
        request: Some("EmbeddingRequest"),
        success: Success::Json("EmbeddingResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/score",
        summary: "Scores of text pairs (vLLM's score, for a pooling model): for an embedding \
                  model the cosine similarity of their embeddings, for a cross-encoder its score of \
                  the two texts read together; one text_1 against each text_2, or the two one to \
                  one",
        request: Some("ScoreRequest"),
        success: Success::Json("ScoreResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/rerank",
        summary: RERANK_SUMMARY,
        request: Some("RerankRequest"),
        success: Success::Json("RerankResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v1/rerank",
        summary: RERANK_SUMMARY,
        request: Some("RerankRequest"),
        success: Success::Json("RerankResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/v2/rerank",
        summary: RERANK_SUMMARY,
        request: Some("RerankRequest"),
        success: Success::Json("RerankResponse"),
        errors: GENERATION_ERRORS,
    },
    Route {
        method: HttpMethod::Get,
        path: "/v1/responses/{id}",
        summary: "A stored response, as it was answered",
        request: None,
        success: Success::Json("ResponseObject"),
        errors: &[400, 404, 500],
    },
    Route {
        method: HttpMethod::Delete,
        path: "/v1/responses/{id}",
        summary: "Delete a stored response",
        request: None,
        success: Success::Json("DeletedResponse"),
        errors: &[404, 500],
    },
    Route {
        method: HttpMethod::Get,
        path: "/v1/responses/{id}/input_items",
        summary: "A page of a stored response's input items (query: limit, order, after)",
        request: None,
        success: Success::Json("InputItemList"),
        errors: &[400, 404, 500],
    },
    Route {
        method: HttpMethod::Get,
        path: "/v1/models",
        summary: "The served model",
        request: None,
        success: Success::Json("ModelList"),
        errors: &[503],
    },
    Route {
        method: HttpMethod::Get,
        path: "/v1/models/{model}",
        summary: "The served model's card, if `model` names it",
        request: None,
        success: Success::Json("ModelCard"),
        errors: &[404, 503],
    },
    Route {
        method: HttpMethod::Post,
        path: "/tokenize",
        summary:
            "Token ids of a prompt, or of messages rendered through the chat template (vLLM's)",
        request: Some("TokenizeRequest"),
        success: Success::Json("TokenizeResponse"),
        errors: TOKENIZER_ERRORS,
    },
    Route {
        method: HttpMethod::Post,
        path: "/detokenize",
        summary: "The text of token ids (vLLM's)",
        request: Some("DetokenizeRequest"),
        success: Success::Json("DetokenizeResponse"),
        errors: TOKENIZER_ERRORS,
    },
    Route {
        method: HttpMethod::Get,
        path: "/health",
        summary: "200 while the engine core answers, 503 (no body) while it does not",
        request: None,
        success: Success::Empty,
        errors: &[],
    },
    Route {
        method: HttpMethod::Get,
        path: "/sluice/kv_cache",
        summary: "The block hashes in the engine core's prefix cache, for a cache-aware router",
        request: None,
        success: Success::Json("KvCacheSnapshot"),
        errors: &[500, 503],
    },
    Route {
        method: HttpMethod::Get,
        path: "/sluice/block_pool_audit",
        summary: "The engine core's audit of its KV block pool: every block free or held by a live request",
        request: None,
        success: Success::Json("BlockPoolAudit"),
        errors: &[500, 503],
    },
    Route {
        method: HttpMethod::Get,
        path: "/version",
        summary: "Sluice's version",
        request: None,
        success: Success::Version,
        errors: &[],
    },
    Route {
        method: HttpMethod::Get,
        path: "/metrics",
        summary: "Prometheus metrics",
        request: None,
        success: Success::Prometheus,
        errors: &[],
    },
    Route {
        method: HttpMethod::Get,
        path: "/openapi.json",
        summary: "This document",
        request: None,
        success: Success::Document,
        errors: &[],
    },
];

fn error_description(status: u16) -> &'static str {
    match status {
        400 => "The request is malformed, has a wrong type, a value out of range, does not fit the context, or carries two Authorization (or x-api-key) headers",
        401 => "The API key is missing or wrong (when the server has one)",
        408 => "The request body did not arrive in time",
        404 => "The model does not exist",
        413 => "The request body is too large",
        431 => "The request has too many headers, or too many header bytes",
        429 => "The waiting queue is full; retry later",
        500 => "An internal error",
        503 => "The engine core is not available",
        _ => unreachable!("no route documents status {status}"),
    }
}

fn json(schema: &str) -> Content {
    Content::new(Some(Ref::from_schema_name(schema)))
}

fn success_response(success: &Success) -> ResponseBuilder {
    let ok = ResponseBuilder::new().description("OK");
    match success {
        Success::Json(schema) => ok.content("application/json", json(schema)),
        Success::JsonOrEvents(whole, chunk) => {
            // One server-sent event; `data` is a chunk's JSON, an error's, or `[DONE]`.
            let data = ObjectBuilder::new()
                .schema_type(Type::String)
                .content_media_type("application/json")
                .description(Some(format!(
                    "A {chunk} as JSON, then `[DONE]` after the last; an error mid-stream is an \
                     ErrorResponse as JSON before `[DONE]`"
                )));
            let events = ObjectBuilder::new().property("data", data).required("data");
            ok.content("application/json", json(whole))
                .content("text/event-stream", Content::new(Some(events)))
        }
        Success::JsonOrNamedEvents(whole, sequence) => {
            let name = ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some("The event's type"));
            let data = ObjectBuilder::new()
                .schema_type(Type::String)
                .content_media_type("application/json")
                .description(Some(*sequence));
            let events = ObjectBuilder::new()
                .property("event", name)
                .property("data", data)
                .required("event")
                .required("data");
            ok.content("application/json", json(whole))
                .content("text/event-stream", Content::new(Some(events)))
        }
        Success::Version => {
            let version = ObjectBuilder::new()
                .property("version", ObjectBuilder::new().schema_type(Type::String))
                .property(
                    "cpu_kernels",
                    ObjectBuilder::new()
                        .schema_type(Type::String)
                        .description(Some("The tier of the CPU kernels the workers run, or none")),
                )
                .required("version")
                .required("cpu_kernels");
            ok.content("application/json", Content::new(Some(version)))
        }
        Success::Prometheus => {
            let text = ObjectBuilder::new().schema_type(Type::String);
            ok.content("text/plain", Content::new(Some(text)))
        }
        Success::Document => {
            let document = ObjectBuilder::new().description(Some("An OpenAPI 3.1 document"));
            ok.content("application/json", Content::new(Some(document)))
        }
        Success::Empty => ok,
    }
}

fn responses(route: &Route) -> Responses {
    let mut responses = Responses::new();
    responses.responses.insert(
        "200".into(),
        success_response(&route.success).build().into(),
    );
    if matches!(route.success, Success::Empty) {
        let unavailable = ResponseBuilder::new().description("The engine core is not available");
        responses
            .responses
            .insert("503".into(), unavailable.build().into());
    }
    // Anthropic's routes answer errors in Anthropic's shape (`error_dialect`).
    let error_schema = if is_anthropic_path(route.path) {
        "AnthropicErrorResponse"
    } else {
        "ErrorResponse"
    };
    for status in error_statuses(route) {
        let error = ResponseBuilder::new()
            .description(error_description(status))
            .content("application/json", json(error_schema));
        responses
            .responses
            .insert(status.to_string(), error.build().into());
    }
    responses
}

/// The route's own errors, and those of the layers in front of every route: the head's bounds,
/// the API key on all but /health (a second Authorization header is a 400), and a body's
/// deadline and byte budget.
fn error_statuses(route: &Route) -> std::collections::BTreeSet<u16> {
    let mut statuses: std::collections::BTreeSet<u16> = route.errors.iter().copied().collect();
    statuses.insert(431);
    if route.path != "/health" {
        statuses.extend([400, 401]);
    }
    if route.request.is_some() {
        statuses.extend([408, 413, 429]);
    }
    statuses
}

/// A path parameter for every `{name}` segment of `path`.
fn path_parameters(path: &str) -> Vec<utoipa::openapi::path::Parameter> {
    path.split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .build()
        })
        .collect()
}

fn paths() -> Paths {
    let mut paths = Paths::new();
    for route in ROUTES {
        let request = route.request.map(|schema| {
            RequestBodyBuilder::new()
                .required(Some(Required::True))
                .content("application/json", json(schema))
                .build()
        });
        let operation = OperationBuilder::new()
            .summary(Some(route.summary))
            .parameters(Some(path_parameters(route.path)))
            .request_body(request)
            .responses(responses(route));
        paths.add_path_operation(route.path, vec![route.method.clone()], operation);
    }
    paths
}

/// The whole document, built once per process.
pub fn document() -> &'static Document {
    static DOCUMENT: OnceLock<Document> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut document = Components::openapi();
        document.paths = paths();
        document
    })
}

/// `GET /openapi.json`.
pub async fn serve() -> Response {
    static JSON: OnceLock<String> = OnceLock::new();
    let body = JSON.get_or_init(|| {
        document()
            .to_json()
            .expect("an OpenAPI document of plain values always serializes")
    });
    ([(header::CONTENT_TYPE, "application/json")], body.as_str()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn document_json() -> Value {
        serde_json::to_value(document()).unwrap()
    }

    #[test]
    fn document_is_openapi_3_1() {
        assert_eq!(document_json()["openapi"], "3.1.0");
    }

    #[test]
    fn every_reference_names_a_component() {
        let document = document_json();
        let schemas = document["components"]["schemas"].as_object().unwrap();
        let mut references = Vec::new();
        collect_references(&document, &mut references);
        assert!(references.len() > 20, "{references:?}");
        for reference in references {
            let name = reference
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("unexpected reference {reference}"));
            assert!(
                schemas.contains_key(name),
                "{name} is referenced but not defined"
            );
        }
    }

    fn collect_references(value: &Value, into: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(reference)) = map.get("$ref") {
                    into.push(reference.clone());
                }
                map.values().for_each(|v| collect_references(v, into));
            }
            Value::Array(items) => items.iter().for_each(|v| collect_references(v, into)),
            _ => {}
        }
    }

    #[test]
    fn error_schema_is_openais() {
        let document = document_json();
        let schemas = &document["components"]["schemas"];
        assert_eq!(
            schemas["ErrorResponse"]["properties"]["error"]["$ref"],
            "#/components/schemas/ErrorBody"
        );
        let body = &schemas["ErrorBody"];
        let mut properties: Vec<&str> = body["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        properties.sort_unstable();
        assert_eq!(properties, ["code", "message", "param", "type"]);
        // `param` and `code` are null when they do not apply, but always present.
        let mut required: Vec<&str> = body["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        required.sort_unstable();
        assert_eq!(required, ["code", "message", "param", "type"]);
    }

    #[test]
    fn every_request_field_is_documented() {
        let document = document_json();
        let schemas = &document["components"]["schemas"];
        let sampling = schemas["SamplingFields"]["properties"].as_object().unwrap();
        for field in [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "n",
            "stop",
            "stop_token_ids",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "ignore_eos",
            "min_tokens",
            "stream",
            "stream_options",
            "user",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "priority",
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
        ] {
            assert!(sampling.contains_key(field), "SamplingFields lacks {field}");
        }
        let stream_options = schemas["StreamOptions"]["properties"].as_object().unwrap();
        assert!(stream_options.contains_key("continuous_usage_stats"));
        let completion = serde_json::to_string(&schemas["CompletionRequest"]).unwrap();
        for field in [
            "suffix",
            "add_special_tokens",
            "use_beam_search",
            "length_penalty",
            "early_stopping",
        ] {
            assert!(
                completion.contains(field),
                "CompletionRequest lacks {field}"
            );
        }
        // Unknown fields are collected, not documented as a field of their own.
        assert!(!serde_json::to_string(schemas)
            .unwrap()
            .contains("other_fields"));
        let chat = serde_json::to_string(&schemas["ChatCompletionRequest"]).unwrap();
        for field in [
            "messages",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "SamplingFields",
            "chat_template_kwargs",
            "reasoning_effort",
            "thinking_token_budget",
            "add_special_tokens",
        ] {
            assert!(
                chat.contains(field),
                "ChatCompletionRequest lacks {field}: {chat}"
            );
        }
    }

    /// The documented ranges are written as literals in `#[schema]` attributes; these are the
    /// ones validation names as constants.
    #[test]
    fn documented_limits_are_validations() {
        use crate::api::validate::{MAX_LOGPROBS, MAX_N};
        let document = document_json();
        let schemas = &document["components"]["schemas"];
        assert_eq!(
            schemas["SamplingFields"]["properties"]["n"]["maximum"],
            MAX_N
        );
        // Each request is allOf [SamplingFields, its own fields] (serde's flatten).
        let own = |request: &str| schemas[request]["allOf"][1]["properties"].clone();
        assert_eq!(
            own("CompletionRequest")["logprobs"]["maximum"],
            MAX_LOGPROBS
        );
        assert_eq!(
            own("ChatCompletionRequest")["top_logprobs"]["maximum"],
            MAX_LOGPROBS
        );
    }

    #[test]
    fn generation_routes_document_both_bodies_and_every_error() {
        let document = document_json();
        let operation = &document["paths"]["/v1/chat/completions"]["post"];
        let ok = &operation["responses"]["200"]["content"];
        assert_eq!(
            ok["application/json"]["schema"]["$ref"],
            "#/components/schemas/ChatCompletionResponse"
        );
        assert!(ok["text/event-stream"].is_object());
        for status in ["400", "401", "404", "413", "429", "500", "503"] {
            assert_eq!(
                operation["responses"][status]["content"]["application/json"]["schema"]["$ref"],
                "#/components/schemas/ErrorResponse",
                "{status}"
            );
        }
        assert_eq!(operation["requestBody"]["required"], true);
    }
}
