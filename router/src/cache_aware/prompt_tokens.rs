//! A request's prompt as the token ids its replica's engine core will receive, computed with the
//! frontend's own code (its tokenizer loading, request types and chat template), so that the
//! router's block hashes are the engine's.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use sluice_common::schema::openai::{ChatMessage, Prompt};
use sluice_common::text::chat_template::{ChatTemplate, ChatTemplateError};
use sluice_common::text::piecewise_encoder::{encode_ids, PiecewiseEncoder, DEFAULT_PIECE_BYTES};
use sluice_common::text::tokenizer_file::load_tokenizer;
use tokenizers::Tokenizer;

pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    /// Long prompts in pieces, as the frontend encodes them: the same ids, a bounded peak.
    piecewise: Option<PiecewiseEncoder>,
    /// None when the model has none: the frontend then refuses chat requests.
    chat_template: Option<ChatTemplate>,
}

impl PromptTokenizer {
    /// Loads `tokenizer.json` and the chat template of a Hugging Face model folder.
    pub fn load(model_dir: &Path) -> Result<Self, String> {
        let tokenizer = load_tokenizer(model_dir).map_err(|err| err.to_string())?;
        let chat_template = match ChatTemplate::from_model_dir(model_dir) {
            Ok(template) => Some(template),
            Err(ChatTemplateError::Missing) => None,
            Err(err) => return Err(err.to_string()),
        };
        Ok(PromptTokenizer {
            piecewise: PiecewiseEncoder::for_tokenizer(&tokenizer, DEFAULT_PIECE_BYTES),
            tokenizer,
            chat_template,
        })
    }

    /// The prompt token ids of a `/v1/completions` or `/v1/chat/completions` body (the first
    /// prompt of a batch); None for a body the frontend would refuse, which needs no routing
    /// cleverness.
    pub fn prompt_token_ids(&self, path: &str, body: &Value) -> Option<Vec<u32>> {
        if path.ends_with("/chat/completions") {
            // A request's own template (vLLM's `chat_template`) renders tokens the model's does not.
            if body.get("chat_template").is_some_and(|t| !t.is_null()) {
                return None;
            }
            let messages = Vec::<ChatMessage>::deserialize(body.get("messages")?).ok()?;
            let add_generation_prompt = match body.get("add_generation_prompt") {
                None | Some(Value::Null) => true,
                Some(value) => value.as_bool()?,
            };
            let text = self
                .chat_template
                .as_ref()?
                .render(&messages, add_generation_prompt)
                .ok()?;
            // As the frontend does: the template already wrote the special tokens.
            return self.encode(text, false);
        }
        if path.ends_with("/completions") {
            return match Prompt::deserialize(body.get("prompt")?).ok()? {
                Prompt::Text(text) => self.encode(text, true),
                Prompt::Texts(texts) => self.encode(texts.into_iter().next()?, true),
                Prompt::Tokens(ids) => Some(ids),
                Prompt::TokenLists(lists) => lists.into_iter().next(),
            };
        }
        None
    }

    fn encode(&self, text: String, add_special_tokens: bool) -> Option<Vec<u32>> {
        encode_ids(
            self.piecewise.as_ref(),
            &self.tokenizer,
            &text,
            add_special_tokens,
        )
        .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sluice_common::text::default_model::default_model_dir as model_dir;

    #[test]
    fn prompts_tokenize_as_the_frontend_sends_them() {
        let dir = model_dir();
        let prompts = PromptTokenizer::load(&dir).unwrap();
        let tokenizer = load_tokenizer(&dir).unwrap();
        let direct = |text: &str, special: bool| -> Vec<u32> {
            tokenizer.encode(text, special).unwrap().get_ids().to_vec()
        };
        let completion = json!({"model": "m", "prompt": "Hello there, router"});
        assert_eq!(
            prompts.prompt_token_ids("/v1/completions", &completion),
            Some(direct("Hello there, router", true))
        );
        let batch = json!({"model": "m", "prompt": ["first", "second"]});
        assert_eq!(
            prompts.prompt_token_ids("/v1/completions", &batch),
            Some(direct("first", true))
        );
        let ids = json!({"model": "m", "prompt": [5, 6, 7]});
        assert_eq!(
            prompts.prompt_token_ids("/v1/completions", &ids),
            Some(vec![5, 6, 7])
        );
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "Hi!"}]});
        let template = ChatTemplate::from_model_dir(&dir).unwrap();
        let messages: Vec<ChatMessage> =
            serde_json::from_value(json!([{"role": "user", "content": "Hi!"}])).unwrap();
        let rendered = template.render(&messages, true).unwrap();
        assert!(rendered.contains("Hi!"));
        assert_eq!(
            prompts.prompt_token_ids("/v1/chat/completions", &chat),
            Some(direct(&rendered, false))
        );
        // A request's own template: the router cannot know its tokens.
        let mut own_template = chat.clone();
        own_template["chat_template"] = json!("{{ messages[0]['content'] }}");
        assert_eq!(
            prompts.prompt_token_ids("/v1/chat/completions", &own_template),
            None
        );
        for bad in [json!({"prompt": 3}), json!({"messages": "x"}), json!({})] {
            assert_eq!(prompts.prompt_token_ids("/v1/completions", &bad), None);
            assert_eq!(prompts.prompt_token_ids("/v1/chat/completions", &bad), None);
        }
    }
}
