//! A prompt's logprobs in the response shapes: completions' `echo` with `logprobs` (the prompt's
//! tokens lead the choice's logprobs) and vLLM's `prompt_logprobs` field.

use std::collections::BTreeMap;

use crate::api::token_label::TokenLabel;
use crate::text::prompt_logprobs::PromptToken;
use sluice_common::schema::openai::{CompletionLogprobs, PromptTokenLogprob};

/// The prompt's part of an echoing choice's logprobs: the first token has neither a logprob nor
/// alternatives (as in OpenAI's API); each other one its logprob and the top `top_n` with the
/// token itself among them, as the generated tokens' entries have.
pub fn echo_logprobs(tokens: &[PromptToken], top_n: u32, label: TokenLabel) -> CompletionLogprobs {
    let mut logprobs = CompletionLogprobs::default();
    for token in tokens {
        let name = label.of(token.token_id, &token.token);
        logprobs.tokens.push(name.clone());
        logprobs.text_offset.push(token.text_offset);
        logprobs
            .token_logprobs
            .push(token.logprob.as_ref().map(|entry| entry.logprob));
        logprobs
            .top_logprobs
            .push(token.logprob.as_ref().map(|entry| {
                let mut top: BTreeMap<String, f64> = entry
                    .top
                    .iter()
                    .take(top_n as usize)
                    .map(|(id, text, logprob)| (label.of(*id, text), *logprob))
                    .collect();
                top.entry(name.clone()).or_insert(entry.logprob);
                top
            }));
    }
    logprobs
}

/// `first` followed by `then`: echoed prompt tokens, then the generated ones.
pub fn joined(mut first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs {
    first.tokens.extend(then.tokens);
    first.token_logprobs.extend(then.token_logprobs);
    first.top_logprobs.extend(then.top_logprobs);
    first.text_offset.extend(then.text_offset);
    first
}

/// vLLM's `prompt_logprobs`: null for the first token; for each other one, keyed by token id,
/// the actual token with its rank and the top `top_n` ranked 1.. (the actual token keeps its own
/// entry when it is among them).
pub fn vllm_prompt_logprobs(
    tokens: &[PromptToken],
    top_n: u32,
) -> Vec<Option<BTreeMap<String, PromptTokenLogprob>>> {
    tokens
        .iter()
        .map(|token| {
            token.logprob.as_ref().map(|entry| {
                let mut ranked = BTreeMap::from([(
                    token.token_id.to_string(),
                    PromptTokenLogprob {
                        logprob: entry.logprob,
                        rank: entry.rank,
                        decoded_token: token.token.clone(),
                    },
                )]);
                for (rank, (id, text, logprob)) in entry.top.iter().take(top_n as usize).enumerate()
                {
                    ranked
                        .entry(id.to_string())
                        .or_insert_with(|| PromptTokenLogprob {
                            logprob: *logprob,
                            rank: rank as u32 + 1,
                            decoded_token: text.clone(),
                        });
                }
                ranked
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::prompt_logprobs::PromptLogprob;

    fn prompt() -> Vec<PromptToken> {
        vec![
            PromptToken {
                token_id: 10,
                token: "The".into(),
                text_offset: 0,
                logprob: None,
            },
            PromptToken {
                token_id: 11,
                token: " cat".into(),
                text_offset: 3,
                logprob: Some(PromptLogprob {
                    logprob: -4.0,
                    rank: 7,
                    top: vec![(12, " dog".into(), -1.0), (11, " cat".into(), -4.0)],
                }),
            },
            PromptToken {
                token_id: 13,
                token: " sat".into(),
                text_offset: 7,
                logprob: Some(PromptLogprob {
                    logprob: -0.5,
                    rank: 1,
                    top: vec![(13, " sat".into(), -0.5), (14, " ran".into(), -2.0)],
                }),
            },
        ]
    }

    #[test]
    fn echoed_tokens_lead_with_no_logprob_for_the_first() {
        let logprobs = echo_logprobs(&prompt(), 1, TokenLabel::Text);
        assert_eq!(logprobs.tokens, ["The", " cat", " sat"]);
        assert_eq!(logprobs.token_logprobs, [None, Some(-4.0), Some(-0.5)]);
        assert_eq!(logprobs.text_offset, [0, 3, 7]);
        assert_eq!(logprobs.top_logprobs[0], None);
        // Top 1 plus the actual token.
        assert_eq!(
            logprobs.top_logprobs[1],
            Some(BTreeMap::from([
                (" dog".into(), -1.0),
                (" cat".into(), -4.0)
            ]))
        );
        assert_eq!(
            logprobs.top_logprobs[2],
            Some(BTreeMap::from([(" sat".into(), -0.5)]))
        );
        let generated = CompletionLogprobs {
            tokens: vec![" on".into()],
            token_logprobs: vec![Some(-0.1)],
            top_logprobs: vec![None],
            text_offset: vec![11],
        };
        let both = joined(logprobs, generated);
        assert_eq!(both.tokens, ["The", " cat", " sat", " on"]);
        assert_eq!(both.text_offset, [0, 3, 7, 11]);
    }

    #[test]
    fn echoed_tokens_named_by_id_keep_their_text_offsets() {
        let logprobs = echo_logprobs(&prompt(), 1, TokenLabel::Id);
        assert_eq!(
            logprobs.tokens,
            ["token_id:10", "token_id:11", "token_id:13"]
        );
        assert_eq!(logprobs.text_offset, [0, 3, 7]);
        assert_eq!(
            logprobs.top_logprobs[1],
            Some(BTreeMap::from([
                ("token_id:12".into(), -1.0),
                ("token_id:11".into(), -4.0)
            ]))
        );
    }

    #[test]
    fn vllm_shape_keys_by_token_id_with_ranks() {
        let logprobs = vllm_prompt_logprobs(&prompt(), 2);
        assert_eq!(logprobs.len(), 3);
        assert_eq!(logprobs[0], None);
        let second = logprobs[1].as_ref().unwrap();
        assert_eq!(second.len(), 2);
        assert_eq!((second["11"].rank, second["11"].logprob), (7, -4.0));
        assert_eq!(
            (second["12"].rank, second["12"].decoded_token.as_str()),
            (1, " dog")
        );
        let third = logprobs[2].as_ref().unwrap();
        assert_eq!(third["13"].rank, 1);
        assert_eq!(third["14"].rank, 2);
        let json = serde_json::to_value(&logprobs).unwrap();
        assert_eq!(json[0], serde_json::Value::Null);
        assert_eq!(json[2]["14"]["decoded_token"], " ran");
    }
}
