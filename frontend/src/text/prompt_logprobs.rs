//! A prompt's logprobs as text: each prompt token's text and where it starts in the prompt's
//! text, with its logprob, rank and top alternatives (the first prompt token has none).
//!
//! Offsets count characters of the prompt decoded as the echo decodes it (special tokens
//! skipped), one token at a time through the incremental detokenizer, so a token that ends
//! inside a multi-byte character shares its start with the token that completes it.

use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::engine::protocol::Logprobs;
use crate::text::detokenizer::{DetokenizeError, IncrementalDetokenizer};

/// One prompt token, as text.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptToken {
    pub token_id: u32,
    pub token: String,
    /// Where the token's text starts in the decoded prompt, in characters.
    pub text_offset: u32,
    /// None for the first prompt token, which nothing predicts.
    pub logprob: Option<PromptLogprob>,
}

/// A prompt token's logprob under the model and the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub logprob: f64,
    /// 1 = the most likely token.
    pub rank: u32,
    /// The top N (token id, text, logprob), most likely first.
    pub top: Vec<(u32, String, f64)>,
}

/// The prompt's tokens with the engine's entries for positions 1.. (`entries[i]` is position
/// i + 1's: the actual token first, then the top N).
pub fn prompt_token_logprobs(
    tokenizer: &Arc<Tokenizer>,
    prompt: &[u32],
    entries: &[Logprobs],
) -> Result<Vec<PromptToken>, DetokenizeError> {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let mut detokenizer = IncrementalDetokenizer::new(tokenizer.clone(), true);
    let mut offset = 0u32;
    let mut tokens = Vec::with_capacity(prompt.len());
    for (position, &token_id) in prompt.iter().enumerate() {
        let logprob = position
            .checked_sub(1)
            .and_then(|index| entries.get(index))
            .map(|entry| PromptLogprob {
                logprob: entry.own_logprob(),
                rank: entry.sampled_rank,
                top: entry.alternatives(text),
            });
        tokens.push(PromptToken {
            token_id,
            token: text(token_id),
            text_offset: offset,
            logprob,
        });
        offset += detokenizer.push(&[token_id])?.chars().count() as u32;
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::text::default_model::load_default_model_tokenizer;

    #[test]
    fn offsets_index_the_decoded_prompt_and_the_first_token_has_no_logprob() {
        let tokenizer = Arc::new(load_default_model_tokenizer());
        let text = "The café serves 日本語 tea.";
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() > 6);
        let entries: Vec<Logprobs> = ids[1..]
            .iter()
            .enumerate()
            .map(|(i, &id)| Logprobs {
                token_ids: vec![id, ids[0]],
                logprobs: vec![-(i as f64), -0.5],
                sampled_rank: i as u32 + 1,
            })
            .collect();
        let tokens = prompt_token_logprobs(&tokenizer, &ids, &entries).unwrap();
        assert_eq!(tokens.len(), ids.len());
        assert_eq!(tokens[0].logprob, None);
        assert_eq!(tokens[0].text_offset, 0);
        let chars: Vec<char> = text.chars().collect();
        for (i, token) in tokens.iter().enumerate() {
            assert_eq!(token.token_id, ids[i]);
            // Each offset is where the decoded prefix before the token ends.
            let before = tokenizer.decode(&ids[..i], true).unwrap();
            if !before.contains('\u{FFFD}') {
                assert_eq!(
                    token.text_offset as usize,
                    before.chars().count(),
                    "token {i}"
                );
            }
            assert!((token.text_offset as usize) <= chars.len());
            if i > 0 {
                let logprob = token.logprob.as_ref().unwrap();
                assert_eq!(logprob.logprob, -((i - 1) as f64));
                assert_eq!(logprob.rank, i as u32);
                assert_eq!(logprob.top, vec![(ids[0], tokens[0].token.clone(), -0.5)]);
            }
        }
        // An ASCII token's offset is exactly its place in the text.
        let tea = tokens.iter().find(|t| t.token == " tea").unwrap();
        assert_eq!(
            tea.text_offset as usize,
            text.find(" tea")
                .map(|b| text[..b].chars().count())
                .unwrap()
        );
    }
}
