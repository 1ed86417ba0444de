//! How a response's logprobs name their tokens.

/// By text, or, with vLLM's `return_tokens_as_token_ids`, as `token_id:N`: exact even where a
/// token is not valid UTF-8 on its own (its text shows a replacement character) and where two
/// tokens decode to the same text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenLabel {
    Text,
    Id,
}

impl TokenLabel {
    pub fn new(return_tokens_as_token_ids: bool) -> Self {
        if return_tokens_as_token_ids {
            TokenLabel::Id
        } else {
            TokenLabel::Text
        }
    }

    pub fn of(self, token_id: u32, text: &str) -> String {
        match self {
            TokenLabel::Text => text.to_owned(),
            TokenLabel::Id => format!("token_id:{token_id}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_named_by_its_text_or_by_its_id() {
        assert_eq!(TokenLabel::new(false).of(42, " Paris"), " Paris");
        assert_eq!(TokenLabel::new(true).of(42, " Paris"), "token_id:42");
    }
}
