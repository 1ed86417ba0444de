//! Preparing a request for the engine, once its fields are valid: the chat template and tools
//! rendered, the prompts tokenized and truncated, admission, and each prompt's token budget. One
//! entry point per endpoint ([`completion`], [`chat`], [`embeddings`], [`score`], [`rerank`],
//! [`tokenize`]) returns a typed, complete request; the field rules are `validate`'s, the typed
//! values `valid_request`'s.

use std::collections::HashMap;

use futures::future::try_join_all;

use crate::api::admission;
use crate::api::beam_search;
use crate::api::error::ApiError;
use crate::api::request_fields::{self, Endpoint};
use crate::api::tools::{self, ValidTools};
use crate::api::valid_request::{
    check_chat_fields, check_completion_fields, ValidPrompt, ValidRequest,
};
use crate::api::validate::{
    chat_ending, check_input_count, check_messages, check_model_name, check_pair_input,
    check_priority, check_prompt_not_empty, check_served_route, check_token_ids,
    effective_max_tokens, embedding_dimensions, embedding_input, encoding_format, out_of_range,
    score_pairs, template_kwargs, top_n, truncated_prompt, EncodingFormat, Route, ServedModel,
    DEFAULT_COMPLETION_MAX_TOKENS,
};
use crate::engine::protocol::{PoolingParams, SamplingParams, ThinkingBudget};
use crate::state::{AppState, EngineNotReady};
use crate::text::reasoning::{THINK_END, THINK_START};
use crate::text::tool_prompt;
use sluice_common::schema::openai::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, EmbeddingRequest, Prompt,
    TokenizeRequest,
};
use sluice_common::schema::openai_tools::Tool;
use sluice_common::schema::score::{RerankRequest, ScoreRequest};
use sluice_common::text::chat_template::{continue_final_message, message_text, ChatTemplateError};

pub fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    check_model_name(model, &state.config.served_model_name)
}

/// A route refused when the engine serves a model that it does not (see `check_served_route`).
/// Until the engine core is ready its model is unknown: the request goes on to be validated, and
/// then to the 503 that the engine's absence answers.
pub fn check_route(state: &AppState, route: Route) -> Result<(), ApiError> {
    match state.engine() {
        Ok(engine) => check_served_route(
            ServedModel::of(engine.ready()),
            route,
            &state.config.served_model_name,
        ),
        Err(EngineNotReady) => Ok(()),
    }
}

/// `POST /v1/completions`: text prompts tokenized (with special tokens), token prompts checked.
pub async fn completion(
    state: &AppState,
    request: CompletionRequest,
) -> Result<ValidRequest, ApiError> {
    check_model(state, &request.model)?;
    let mut sampling = check_completion_fields(&request, state.vocab_size)?;
    check_priority(
        request.sampling.priority.unwrap_or(0),
        state.config.scheduling_policy,
    )?;
    let ignored_fields = sampling.ignored_fields(Endpoint::Completions, &request.other_fields)?;
    let constrained = sampling.structured_output.as_ref().map(|c| c.field);
    let beam_search = beam_search::check(&request, constrained)?;
    // Before any prompt is tokenized: a request that can never be admitted is refused at once.
    admission::check_fits(
        state,
        admission::prompt_count(&request.prompt) * sampling.best_of as usize,
        "n",
    )?;
    sampling.tokenize_bad_words(state).await?;
    let echo = request.echo.unwrap_or(false);
    let max_model_len = state.max_model_len()?;
    let add_special_tokens = request.add_special_tokens.unwrap_or(true);
    let inputs = prompt_inputs(state, request.prompt.clone(), add_special_tokens).await?;
    if inputs.is_empty() {
        check_prompt_not_empty(&[])?;
    }
    let mut prompts = Vec::with_capacity(inputs.len());
    for input in inputs {
        check_prompt_not_empty(&input.ids)?;
        check_token_ids("prompt", &input.ids, state.vocab_size)?;
        let (ids, cut) = truncated_prompt(
            input.ids,
            request.sampling.truncate_prompt_tokens,
            max_model_len,
        )?;
        let max_tokens = effective_max_tokens(
            ids.len(),
            request.sampling.max_tokens,
            Some(DEFAULT_COMPLETION_MAX_TOKENS),
            max_model_len,
        )?;
        // A cut prompt echoes what the model saw.
        let echo = match (echo, input.text) {
            (false, _) => None,
            (true, Some(text)) if !cut => Some(text),
            (true, _) => Some(state.pool.decode(ids.clone(), true).await?),
        };
        prompts.push(ValidPrompt {
            token_ids: ids,
            echo,
            params: sampling.params(max_tokens),
            second_text_start: None,
        });
    }
    let mut valid = sampling.response(request.model.clone(), prompts, ignored_fields);
    valid.beam_search = beam_search;
    Ok(valid)
}

/// `POST /v1/embeddings`: each input tokenized (text with special tokens, no chat template) or
/// checked, cut as `truncate_prompt_tokens` asks, and made a pooling request of its own; with the
/// encoding its embeddings are answered in.
pub async fn embeddings(
    state: &AppState,
    request: EmbeddingRequest,
) -> Result<(ValidRequest, EncodingFormat), ApiError> {
    check_model(state, &request.model)?;
    let priority = request.priority.unwrap_or(0);
    check_priority(priority, state.config.scheduling_policy)?;
    let format = encoding_format(request.encoding_format.as_deref())?;
    let ready = state.engine()?.ready();
    let pooling = PoolingParams {
        dimensions: embedding_dimensions(
            request.dimensions,
            ready.embedding_size,
            ready.matryoshka_dimensions.as_deref(),
            &request.model,
        )?,
        normalize: request.normalize,
    };
    let ignored_fields =
        request_fields::ignored_fields(Endpoint::Embeddings, &request.other_fields, [])?;
    let count = admission::prompt_count(&request.input);
    check_input_count(count)?;
    // Before any input is tokenized: a request that can never be admitted is refused at once.
    admission::check_fits(state, count, "input")?;
    let add_special_tokens = request.add_special_tokens.unwrap_or(true);
    let inputs = pooling_inputs(
        state,
        "input",
        request.input,
        add_special_tokens,
        request.truncate_prompt_tokens,
    )
    .await?;
    let inputs = inputs.into_iter().map(|ids| (ids, None));
    let valid = pooling_request(request.model, inputs, priority, ignored_fields, pooling);
    Ok((valid, format))
}

/// A `/score` or `/rerank` request that passed validation: its pooling requests, and how their
/// answers become the scores.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidScore {
    pub request: ValidRequest,
    pub scoring: Scoring,
}

/// How a score's pooling requests are answered, and so read.
#[derive(Debug, Clone, PartialEq)]
pub enum Scoring {
    /// An embedding model's (a bi-encoder's): one pooling request per distinct text, and the
    /// pairs of them (indices into the request's prompts) whose cosines are the scores, in the
    /// order they are answered.
    Cosines(Vec<(usize, usize)>),
    /// A cross-encoder's: one pooling request per pair, in the order they are answered, each
    /// answered with its score.
    CrossEncoder,
}

/// A `/rerank` request that passed validation: its pairs are the query with each document.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRerank {
    pub score: ValidScore,
    /// The best N results, or None for all of them.
    pub top_n: Option<usize>,
    /// The documents' texts, when the results carry them (`return_documents`).
    pub documents: Option<Vec<String>>,
}

/// Whether the engine core serves a cross-encoder. Until it is ready that is unknown, and the
/// request goes on as an embedding model's, to the 503 that the engine's absence answers.
fn serves_cross_encoder(state: &AppState) -> bool {
    state
        .engine()
        .is_ok_and(|engine| ServedModel::of(engine.ready()) == ServedModel::CrossEncoder)
}

/// The fields /score and /rerank refuse: a cross-encoder's refuse more.
fn score_endpoint(cross_encoder: bool) -> Endpoint {
    if cross_encoder {
        Endpoint::CrossEncoderScore
    } else {
        Endpoint::Score
    }
}

/// `POST /score` (vLLM's): one `text_1` against each `text_2`, or the two one to one.
pub async fn score(state: &AppState, request: ScoreRequest) -> Result<ValidScore, ApiError> {
    check_model(state, &request.model)?;
    let cross_encoder = serves_cross_encoder(state);
    let ignored_fields =
        request_fields::ignored_fields(score_endpoint(cross_encoder), &request.other_fields, [])?;
    scored_pairs(
        state,
        request.model,
        [("text_1", request.text_1), ("text_2", request.text_2)],
        request.truncate_prompt_tokens,
        request.priority,
        ignored_fields,
        cross_encoder,
    )
    .await
}

/// `POST /rerank` (Jina's and Cohere's shape): the query against each document.
pub async fn rerank(state: &AppState, request: RerankRequest) -> Result<ValidRerank, ApiError> {
    check_model(state, &request.model)?;
    let cross_encoder = serves_cross_encoder(state);
    let ignored_fields =
        request_fields::ignored_fields(score_endpoint(cross_encoder), &request.other_fields, [])?;
    let top_n = top_n(request.top_n)?;
    let documents = request
        .return_documents
        .unwrap_or(true)
        .then(|| request.documents.clone());
    let score = scored_pairs(
        state,
        request.model,
        [
            ("query", Prompt::Text(request.query)),
            ("documents", Prompt::Texts(request.documents)),
        ],
        request.truncate_prompt_tokens,
        request.priority,
        ignored_fields,
        cross_encoder,
    )
    .await?;
    Ok(ValidRerank {
        score,
        top_n,
        documents,
    })
}

/// The pairs of a score's two sides (each its field and its texts; see `score_pairs`): for an
/// embedding model every text tokenized and checked as an embeddings input, and each distinct one
/// embedded once; for a cross-encoder each pair tokenized as one prompt (see `cross_encoded`).
async fn scored_pairs(
    state: &AppState,
    model: String,
    [(first, first_texts), (second, second_texts)]: [(&'static str, Prompt); 2],
    truncate_prompt_tokens: Option<i64>,
    priority: Option<i64>,
    ignored_fields: Vec<String>,
    cross_encoder: bool,
) -> Result<ValidScore, ApiError> {
    let priority = priority.unwrap_or(0);
    check_priority(priority, state.config.scheduling_policy)?;
    let pairs = score_pairs(
        (first, admission::prompt_count(&first_texts)),
        (second, admission::prompt_count(&second_texts)),
    )?;
    let pooling = PoolingParams {
        dimensions: None,
        normalize: None,
    };
    if cross_encoder {
        if truncate_prompt_tokens.is_some() {
            return Err(out_of_range(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens is not supported by a cross-encoder: it keeps a text's \
                 last tokens, and a cross-encoder's prompt is a pair of texts between the \
                 template's special tokens"
                    .into(),
            ));
        }
        let sides = [
            (first, pair_texts(first, first_texts)?),
            (second, pair_texts(second, second_texts)?),
        ];
        admission::check_fits(state, pairs.len(), second)?;
        let inputs = cross_encoded(state, sides, &pairs).await?;
        return Ok(ValidScore {
            request: pooling_request(model, inputs, priority, ignored_fields, pooling),
            scoring: Scoring::CrossEncoder,
        });
    }
    let mut inputs =
        pooling_inputs(state, first, first_texts, true, truncate_prompt_tokens).await?;
    inputs.extend(pooling_inputs(state, second, second_texts, true, truncate_prompt_tokens).await?);
    let (inputs, positions) = distinct(inputs);
    admission::check_fits(state, inputs.len(), second)?;
    Ok(ValidScore {
        request: pooling_request(
            model,
            inputs.into_iter().map(|ids| (ids, None)),
            priority,
            ignored_fields,
            pooling,
        ),
        scoring: Scoring::Cosines(
            pairs
                .into_iter()
                .map(|(a, b)| (positions[a], positions[b]))
                .collect(),
        ),
    })
}

/// A cross-encoder's side of a score, `param`'s texts: the pair template joins two texts, not
/// token ids.
fn pair_texts(param: &'static str, texts: Prompt) -> Result<Vec<String>, ApiError> {
    match texts {
        Prompt::Text(text) => Ok(vec![text]),
        Prompt::Texts(texts) => Ok(texts),
        Prompt::Tokens(_) | Prompt::TokenLists(_) => Err(out_of_range(
            param,
            format!(
                "a cross-encoder tokenizes each pair of texts together, with its pair template: \
                 {param} must be text, not token ids"
            ),
        )),
    }
}

/// A cross-encoder's prompts: each of `pairs` (indices into the first side's texts followed by
/// the second's) tokenized as one by the tokenizer's pair template, with where its token type 1
/// starts.
async fn cross_encoded(
    state: &AppState,
    [(first, first_texts), (second, second_texts)]: [(&'static str, Vec<String>); 2],
    pairs: &[(usize, usize)],
) -> Result<Vec<(Vec<u32>, Option<u32>)>, ApiError> {
    let max_model_len = state.max_model_len()?;
    try_join_all(pairs.iter().map(|&(a, b)| {
        let (i, j) = (a, b - first_texts.len());
        let texts = (first_texts[i].clone(), second_texts[j].clone());
        async move {
            let pair = state.pool.encode_pair(texts.0, texts.1).await?;
            let [first_tokens, second_tokens] = pair.text_tokens;
            check_pair_input(
                [(first, i, first_tokens), (second, j, second_tokens)],
                &pair.token_ids,
                max_model_len,
                state.vocab_size,
            )?;
            Ok::<_, ApiError>((pair.token_ids, pair.second_text_start))
        }
    }))
    .await
}

/// The distinct token lists of `inputs`, first seen first, and where each input is among them.
fn distinct(inputs: Vec<Vec<u32>>) -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut seen = HashMap::new();
    let mut distinct = Vec::new();
    let positions = inputs
        .into_iter()
        .map(|ids| {
            let next = distinct.len();
            let at = *seen.entry(ids.clone()).or_insert(next);
            if at == next {
                distinct.push(ids);
            }
            at
        })
        .collect();
    (distinct, positions)
}

/// The inputs of the field `param`, tokenized (text with special tokens when asked, no chat
/// template) or checked, and cut as `truncate_prompt_tokens` asks (see `embedding_input`).
async fn pooling_inputs(
    state: &AppState,
    param: &'static str,
    input: Prompt,
    add_special_tokens: bool,
    truncate_prompt_tokens: Option<i64>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let max_model_len = state.max_model_len()?;
    prompt_inputs(state, input, add_special_tokens)
        .await?
        .into_iter()
        .enumerate()
        .map(|(index, input)| {
            embedding_input(
                param,
                index,
                input.ids,
                truncate_prompt_tokens,
                max_model_len,
                state.vocab_size,
            )
        })
        .collect()
}

/// A request of one pooling request per input in `inputs`: its tokens, and a cross-encoder's
/// pair's `second_text_start`.
fn pooling_request(
    model: String,
    inputs: impl IntoIterator<Item = (Vec<u32>, Option<u32>)>,
    priority: i64,
    ignored_fields: Vec<String>,
    pooling: PoolingParams,
) -> ValidRequest {
    let prompts = inputs
        .into_iter()
        .map(|(token_ids, second_text_start)| ValidPrompt {
            token_ids,
            echo: None,
            // The engine checks a pooling request's params as any request's, and samples nothing.
            params: SamplingParams {
                max_tokens: 1,
                ..SamplingParams::default()
            },
            second_text_start,
        })
        .collect();
    ValidRequest {
        model,
        prompts,
        n: 1,
        best_of: 1,
        priority,
        ignored_fields,
        pooling: Some(pooling),
        ..ValidRequest::default()
    }
}

/// A prompt as token ids, with its text when the client sent text.
struct PromptInput {
    ids: Vec<u32>,
    text: Option<String>,
}

async fn prompt_inputs(
    state: &AppState,
    prompt: Prompt,
    add_special_tokens: bool,
) -> Result<Vec<PromptInput>, ApiError> {
    let texts = match prompt {
        Prompt::Text(text) => vec![text],
        Prompt::Texts(texts) => texts,
        Prompt::Tokens(ids) => return Ok(vec![PromptInput { ids, text: None }]),
        Prompt::TokenLists(lists) => {
            return Ok(lists
                .into_iter()
                .map(|ids| PromptInput { ids, text: None })
                .collect())
        }
    };
    try_join_all(texts.into_iter().map(|text| async move {
        let ids = state.pool.encode(text.clone(), add_special_tokens).await?;
        Ok::<_, ApiError>(PromptInput {
            ids,
            text: Some(text),
        })
    }))
    .await
}

/// `POST /v1/chat/completions`: the messages rendered with the chat template, then tokenized.
pub async fn chat(
    state: &AppState,
    request: ChatCompletionRequest,
) -> Result<ValidRequest, ApiError> {
    check_model(state, &request.model)?;
    check_messages(&request.messages)?;
    let (mut sampling, max_tokens) = check_chat_fields(&request, state.vocab_size)?;
    check_priority(
        request.sampling.priority.unwrap_or(0),
        state.config.scheduling_policy,
    )?;
    let kwargs = template_kwargs(
        request.chat_template_kwargs.as_ref(),
        request.reasoning_effort.as_ref(),
    )?;
    let ignored_fields = sampling.ignored_fields(Endpoint::Chat, &request.other_fields)?;
    let ValidTools {
        rendered,
        reader,
        structured_output: forced_tool_call,
        lazy_grammar,
    } = tools::check_tools(&request, state.tool_call_parser.clone())?;
    if let (Some(_), Some(constraint)) = (&forced_tool_call, &sampling.structured_output) {
        return Err(out_of_range(
            "tool_choice",
            format!(
                "a required or named tool_choice is forced with structured output, so it cannot \
                 be combined with {}",
                constraint.field
            ),
        ));
    }
    sampling.tokenize_bad_words(state).await?;
    let max_model_len = state.max_model_len()?;
    let (add_generation_prompt, _) = chat_ending(
        request.add_generation_prompt,
        request.continue_final_message,
    )?;
    let role = chat_answer_role(&request.messages, add_generation_prompt);
    let echo = chat_echo(&request, &role)?;
    let text = chat_text(
        state,
        request.messages.clone(),
        request.add_generation_prompt,
        request.continue_final_message,
        kwargs,
        rendered,
        request.chat_template.clone(),
    )
    .await?;
    let reasoning_starts_thinking = state
        .config
        .reasoning_parser
        .map(|parser| parser.starts_thinking(&text));
    // By default none: the template already wrote the special tokens.
    let add_special_tokens = request.add_special_tokens.unwrap_or(false);
    let token_ids = state.pool.encode(text, add_special_tokens).await?;
    check_prompt_not_empty(&token_ids)?;
    let (token_ids, _) = truncated_prompt(
        token_ids,
        request.sampling.truncate_prompt_tokens,
        max_model_len,
    )?;
    let max_tokens = effective_max_tokens(token_ids.len(), max_tokens, None, max_model_len)?;
    let mut params = sampling.params(max_tokens);
    // The tools' constraint: a forced call, or auto's lazy grammar, unless it is switched off or
    // the request brings a constraint of its own (which then decides what the output is).
    let lazy_grammar = lazy_grammar
        .filter(|_| state.config.tool_call_grammar && params.structured_output.is_none());
    let tools_constraint = forced_tool_call.or(lazy_grammar);
    let constrained_by_tools = tools_constraint.is_some();
    if tools_constraint.is_some() {
        params.structured_output = tools_constraint;
    }
    // A reasoning model's thinking runs free: the constraint is on the answer after it.
    if let (Some(true), Some(constraint)) =
        (reasoning_starts_thinking, params.structured_output.as_mut())
    {
        constraint.after = THINK_END.into();
    }
    if let Some(budget) = request.thinking_token_budget {
        params.thinking_budget =
            Some(thinking_budget(state, budget, reasoning_starts_thinking).await?);
    }
    let prompt = ValidPrompt {
        token_ids,
        echo,
        params,
        second_text_start: None,
    };
    let mut valid = sampling.response(request.model.clone(), vec![prompt], ignored_fields);
    valid.tool_calls = reader;
    valid.chat_role = Some(role);
    valid.reasoning_starts_thinking = reasoning_starts_thinking;
    if constrained_by_tools {
        // The constraint's schemas are the tools' parameters: a schema that cannot compile is theirs.
        valid.structured_output_field = Some("tools");
    }
    Ok(valid)
}

/// `thinking_token_budget` as the engine core's budget: the thinking's tags as the model's
/// tokens, the opening one only where the output must write it (the prompt did not open it).
async fn thinking_budget(
    state: &AppState,
    max_tokens: u32,
    starts_thinking: Option<bool>,
) -> Result<ThinkingBudget, ApiError> {
    let Some(starts_thinking) = starts_thinking else {
        return Err(ApiError::InvalidParameter {
            param: "thinking_token_budget",
            message: "thinking_token_budget needs a reasoning model whose thinking is split out: \
                      this server was started without --reasoning-parser"
                .into(),
        });
    };
    let start_token_ids = if starts_thinking {
        Vec::new()
    } else {
        state.pool.encode(THINK_START.into(), false).await?
    };
    let end_token_ids = state.pool.encode(THINK_END.into(), false).await?;
    Ok(ThinkingBudget {
        max_tokens,
        start_token_ids,
        end_token_ids,
    })
}

/// The role of a chat answer, as vLLM gives it: a generation prompt starts the assistant's turn;
/// without one the answer goes on with the final message, so it has that message's role.
fn chat_answer_role(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    match messages.last() {
        Some(last) if !add_generation_prompt => last.role.clone(),
        _ => "assistant".into(),
    }
}

/// Chat's `echo`, as vLLM's: the final message's text leads every choice's content when that
/// message has the role the answer has (`role`); otherwise there is nothing to echo.
fn chat_echo(request: &ChatCompletionRequest, role: &str) -> Result<Option<String>, ApiError> {
    let Some(last) = request.messages.last() else {
        return Ok(None);
    };
    if request.echo != Some(true) || last.role != role {
        return Ok(None);
    }
    let text = message_text(last).map_err(|error| ApiError::InvalidParameter {
        param: "messages",
        message: error.to_string(),
    })?;
    Ok(Some(text.into_owned()))
}

/// A `/tokenize` request that passed validation: the text to encode, complete.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidTokenize {
    /// The prompt, or the messages rendered with the chat template.
    pub text: String,
    pub add_special_tokens: bool,
    pub return_token_strs: bool,
    pub ignored_fields: Vec<String>,
}

/// `POST /tokenize` (vLLM's): a prompt, or messages rendered as chat renders them, so that the
/// count is the chat request's prompt length.
pub async fn tokenize(
    state: &AppState,
    request: TokenizeRequest,
) -> Result<ValidTokenize, ApiError> {
    if let Some(model) = &request.model {
        check_model(state, model)?;
    }
    let ignored_fields =
        request_fields::ignored_fields(Endpoint::Tokenize, &request.other_fields, [])?;
    let chat_only = [
        (
            "add_generation_prompt",
            request.add_generation_prompt.is_some(),
        ),
        (
            "continue_final_message",
            request.continue_final_message.is_some(),
        ),
        (
            "chat_template_kwargs",
            request.chat_template_kwargs.is_some(),
        ),
        ("chat_template", request.chat_template.is_some()),
        ("tools", request.tools.is_some()),
    ];
    let (text, add_special_tokens) = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            if let Some((param, _)) = chat_only.iter().find(|(_, given)| *given) {
                return Err(ApiError::InvalidParameter {
                    param,
                    message: format!("{param} applies to messages, not to a prompt"),
                });
            }
            (prompt, request.add_special_tokens.unwrap_or(true))
        }
        (None, Some(messages)) => {
            check_messages(&messages)?;
            let tools = request.tools.filter(|tools| !tools.is_empty());
            if let Some(tools) = &tools {
                tools::check_tool_definitions(tools)?;
            }
            let kwargs = template_kwargs(request.chat_template_kwargs.as_ref(), None)?;
            let text = chat_text(
                state,
                messages,
                request.add_generation_prompt,
                request.continue_final_message,
                kwargs,
                tools,
                request.chat_template,
            )
            .await?;
            // The template already wrote the special tokens.
            (text, request.add_special_tokens.unwrap_or(false))
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "give exactly one of `prompt` and `messages`".into(),
            ))
        }
    };
    Ok(ValidTokenize {
        text,
        add_special_tokens,
        return_token_strs: request.return_token_strs.unwrap_or(false),
        ignored_fields,
    })
}

/// Renders checked `messages` (and `tools`) with the model's chat template, given the extra
/// variables `kwargs`, on the tokenizer pool, ending as the request's `add_generation_prompt` and
/// `continue_final_message` (`continue_final`) ask (see `chat_ending`). A template without tools gets them, and the
/// history's calls, as Hermes-style text.
pub async fn chat_text(
    state: &AppState,
    messages: Vec<ChatMessage>,
    add_generation_prompt: Option<bool>,
    continue_final: Option<bool>,
    kwargs: serde_json::Map<String, serde_json::Value>,
    tools: Option<Vec<Tool>>,
    request_template: Option<String>,
) -> Result<String, ApiError> {
    let (add_generation_prompt, continue_final) =
        chat_ending(add_generation_prompt, continue_final)?;
    check_request_template(state, request_template.as_deref())?;
    let model_template = state.chat_template.clone().ok_or_else(|| {
        ApiError::InvalidRequest("this model has no chat template; use /v1/completions".into())
    })?;
    // What fails in the request's own template is that field's fault.
    let faulty_param = if request_template.is_some() {
        "chat_template"
    } else {
        "messages"
    };
    state
        .pool
        .run(move |_| {
            let own;
            let template = match request_template {
                Some(source) => {
                    own = model_template.for_request(source)?;
                    &own
                }
                None => model_template.as_ref(),
            };
            let mut kwargs = kwargs;
            let rendered = if template.uses_tools() {
                // The request's tools win over a template variable of the same name.
                if let Some(tools) = tools {
                    kwargs.insert(
                        "tools".into(),
                        serde_json::to_value(tools).expect("tools always serialize"),
                    );
                }
                template.render_with_kwargs(&messages, add_generation_prompt, &kwargs)?
            } else {
                let messages = tool_prompt::plain_template_messages(&messages, tools.as_deref());
                template.render_with_kwargs(&messages, add_generation_prompt, &kwargs)?
            };
            if continue_final {
                continue_final_message(rendered, &messages)
            } else {
                Ok(rendered)
            }
        })
        .await?
        .map_err(|error| match error {
            ChatTemplateError::Syntax(_) => ApiError::InvalidParameter {
                param: "chat_template",
                message: error.to_string(),
            },
            _ if error.is_request_error() => ApiError::InvalidParameter {
                param: faulty_param,
                message: error.to_string(),
            },
            _ => ApiError::Internal(error.to_string()),
        })
}

/// vLLM's rule: a request may bring its own chat template only to a server that trusts them
/// (`--trust-request-chat-template`), since a template is code that runs on the server.
fn check_request_template(state: &AppState, template: Option<&str>) -> Result<(), ApiError> {
    if template.is_none() || state.config.trust_request_chat_template {
        return Ok(());
    }
    Err(ApiError::InvalidParameter {
        param: "chat_template",
        message: "a request's own chat_template is refused unless the server runs with \
                  --trust-request-chat-template; chat_template_kwargs sets the model template's \
                  variables"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::validate::tests::param_of;

    #[test]
    fn chat_echo_is_the_final_assistant_text_only() {
        let chat = |body: serde_json::Value| -> ChatCompletionRequest {
            serde_json::from_value(body).unwrap()
        };
        let user = serde_json::json!({"role": "user", "content": "Hi"});
        let answer = serde_json::json!({"role": "assistant", "content": [
            {"type": "text", "text": "The answer"}, {"type": "text", "text": "is"}]});
        let echoed =
            chat(serde_json::json!({"model": "m", "messages": [user, answer], "echo": true}));
        assert_eq!(
            chat_echo(&echoed, "assistant"),
            Ok(Some("The answer\nis".to_owned()))
        );
        let unasked = chat(serde_json::json!({"model": "m", "messages": [user, answer]}));
        assert_eq!(chat_echo(&unasked, "assistant"), Ok(None));
        let after_user =
            chat(serde_json::json!({"model": "m", "messages": [answer, user], "echo": true}));
        assert_eq!(chat_echo(&after_user, "assistant"), Ok(None));
        // Without a generation prompt the answer goes on as the user: the user's text is echoed.
        assert_eq!(chat_echo(&after_user, "user"), Ok(Some("Hi".to_owned())));
        let bad_part = serde_json::json!({"role": "assistant", "content": [{"type": "image_url"}]});
        let refused =
            chat(serde_json::json!({"model": "m", "messages": [user, bad_part], "echo": true}));
        assert_eq!(param_of(chat_echo(&refused, "assistant")), "messages");
    }

    #[test]
    fn each_distinct_input_is_kept_once_where_it_was_first_seen() {
        let (kept, positions) = distinct(vec![vec![1, 2], vec![3], vec![1, 2], vec![], vec![3]]);
        assert_eq!(kept, [vec![1, 2], vec![3], vec![]]);
        assert_eq!(positions, [0, 1, 0, 2, 1]);
    }

    #[test]
    fn the_answer_is_the_assistants_unless_it_goes_on_with_the_final_message() {
        let message = |role: &str| -> ChatMessage {
            serde_json::from_value(serde_json::json!({"role": role, "content": "x"})).unwrap()
        };
        let history = [message("system"), message("user")];
        assert_eq!(chat_answer_role(&history, true), "assistant");
        assert_eq!(chat_answer_role(&history, false), "user");
        assert_eq!(
            chat_answer_role(&[message("assistant")], false),
            "assistant"
        );
        assert_eq!(chat_answer_role(&[message("tool")], false), "tool");
    }
}
