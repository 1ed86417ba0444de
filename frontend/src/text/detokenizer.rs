//! Incremental, UTF-8-safe detokenization of a stream of generated token ids.
//!
//! Decoding one token at a time is wrong for two reasons: a byte-level token
//! may carry only part of a multi-byte character (decoding it alone yields
//! U+FFFD), and some decoders look at neighbouring tokens (a leading space is
//! stripped only at the start of the text). So, as vLLM and TGI do, each step
//! decodes a short window of tokens twice — the already-emitted context
//! (`prefix_offset..read_offset`) and the context plus the new tokens
//! (`prefix_offset..`) — and emits the difference, but only once the decoded
//! window no longer ends in an incomplete character.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// What a decoder produces for bytes that do not (yet) form a whole character.
const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

#[derive(Debug, thiserror::Error)]
#[error("detokenization failed: {0}")]
pub struct DetokenizeError(String);

/// Per-request state that turns token ids into text deltas for streaming.
///
/// The deltas returned by [`push`](Self::push) and [`finish`](Self::finish),
/// joined, equal `tokenizer.decode(all_ids, skip_special_tokens)`.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window decoded as context for the next delta.
    prefix_offset: usize,
    /// End of the tokens whose text has already been emitted.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Appends newly generated ids and returns the text that is now safe to emit
    /// (possibly empty while a character is still incomplete).
    pub fn push(&mut self, new_ids: &[u32]) -> Result<String, DetokenizeError> {
        self.ids.extend_from_slice(new_ids);
        let (context_text, window_text) = self.decode_window()?;
        // A trailing U+FFFD is usually a character whose remaining bytes are in
        // tokens not generated yet; emitting it now would emit a broken character.
        if window_text.len() <= context_text.len() || window_text.ends_with(REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        let delta = text_after_context(&window_text, &context_text).to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Flushes the text still held back when the stream ends. A trailing U+FFFD
    /// that the full decode contains is emitted here.
    pub fn finish(&mut self) -> Result<String, DetokenizeError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let (context_text, window_text) = self.decode_window()?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(text_after_context(&window_text, &context_text).to_owned())
    }

    /// Decodes the emitted context alone and the context followed by the pending ids.
    fn decode_window(&self) -> Result<(String, String), DetokenizeError> {
        let context_text = self.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let window_text = self.decode(&self.ids[self.prefix_offset..])?;
        Ok((context_text, window_text))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, DetokenizeError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|error| DetokenizeError(error.to_string()))
    }
}

/// The part of `window_text` that follows the already-emitted `context_text`.
fn text_after_context<'a>(window_text: &'a str, context_text: &str) -> &'a str {
    if let Some(rest) = window_text.strip_prefix(context_text) {
        return rest;
    }
    // A decoder that rewrites text across the boundary (e.g. clean-up of spaces
    // before punctuation) breaks the prefix relation; fall back to byte length,
    // rounded up to a character boundary so the slice stays valid.
    let mut start = context_text.len().min(window_text.len());
    while !window_text.is_char_boundary(start) {
        start += 1;
    }
    &window_text[start..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::text::default_model::load_default_model_tokenizer;

    const UNICODE_TEXT: &str = concat!(
        "Hello, 世界! 日本語のテキストです。中文：你好，世界。한국어: 안녕하세요. ",
        "Emoji: 👋🏽 👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏻‍💻 🇯🇵 ❤️‍🔥. ",
        "Combining: cafe\u{301} nai\u{308}ve Z\u{337}\u{322}\u{34e}a\u{338}l\u{336}g\u{335}o\u{334}. ",
        "RTL: مرحبا بالعالم، שלום עולם. Devanagari: नमस्ते दुनिया. Thai: ภาษาไทย. ",
        "Math: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q, 𝟙𝟚𝟛. Old: 𐍈𐌰𐌹𐍃. Spaces:\u{a0}\u{2003}\u{3000}end."
    );

    fn default_tokenizer() -> Arc<Tokenizer> {
        Arc::new(load_default_model_tokenizer())
    }

    /// Streams `chunks` through a fresh detokenizer and checks every delta.
    fn streamed_text(
        tokenizer: &Arc<Tokenizer>,
        chunks: &[&[u32]],
        skip_special_tokens: bool,
        full_has_replacement: bool,
    ) -> String {
        let mut detokenizer = IncrementalDetokenizer::new(tokenizer.clone(), skip_special_tokens);
        let mut text = String::new();
        for chunk in chunks {
            let delta = detokenizer.push(chunk).unwrap();
            assert!(
                full_has_replacement || !delta.contains(REPLACEMENT_CHARACTER),
                "delta {delta:?} has a U+FFFD the full decode does not have"
            );
            text.push_str(&delta);
        }
        text.push_str(&detokenizer.finish().unwrap());
        text
    }

    fn assert_streams_like_full_decode(tokenizer: &Arc<Tokenizer>, text: &str) {
        let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        let full = tokenizer.decode(&ids, true).unwrap();
        let full_has_replacement = full.contains(REPLACEMENT_CHARACTER);

        let one_at_a_time: Vec<&[u32]> = ids.chunks(1).collect();
        assert_eq!(
            streamed_text(tokenizer, &one_at_a_time, true, full_has_replacement),
            full
        );
        for split in 0..=ids.len() {
            let (head, tail) = ids.split_at(split);
            assert_eq!(
                streamed_text(tokenizer, &[head, tail], true, full_has_replacement),
                full,
                "split at {split}"
            );
        }
    }

    fn unicode_text_ids(tokenizer: &Tokenizer) -> Vec<u32> {
        let encoding = tokenizer.encode(UNICODE_TEXT, false).unwrap();
        encoding.get_ids().to_vec()
    }

    #[test]
    fn unicode_text_streams_equal_to_full_decode_at_every_split() {
        let tokenizer = default_tokenizer();
        let ids = unicode_text_ids(&tokenizer);
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), UNICODE_TEXT);
        // The test only means something if some tokens carry partial characters.
        let partial_tokens = ids
            .iter()
            .filter(|id| {
                let alone = tokenizer.decode(&[**id], true).unwrap();
                alone.contains(REPLACEMENT_CHARACTER)
            })
            .count();
        assert!(partial_tokens > 10, "only {partial_tokens} partial tokens");
        assert_streams_like_full_decode(&tokenizer, UNICODE_TEXT);
    }

    #[test]
    fn each_line_streams_equal_to_full_decode() {
        let tokenizer = default_tokenizer();
        for line in [
            "🏳️‍🌈",
            "👨‍👩‍👧‍👦 family",
            " e\u{301}\u{301}\u{301}",
            "你好",
            "שלום",
            "\u{200f}\u{200e}RLM LRM",
        ] {
            assert_streams_like_full_decode(&tokenizer, line);
        }
    }

    #[test]
    fn random_chunk_sizes_stream_equal_to_full_decode() {
        let tokenizer = default_tokenizer();
        let ids = unicode_text_ids(&tokenizer);
        let full = tokenizer.decode(&ids, true).unwrap();
        // A fixed linear congruential generator keeps the chunkings reproducible.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..50 {
            let mut chunks = Vec::new();
            let mut rest = ids.as_slice();
            while !rest.is_empty() {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let size = ((state >> 33) % 5) as usize;
                let (chunk, tail) = rest.split_at(size.min(rest.len()));
                chunks.push(chunk);
                rest = tail;
            }
            assert_eq!(streamed_text(&tokenizer, &chunks, true, false), full);
        }
    }

    /// GPT-2's byte-to-character table: the vocabulary spells every byte as one character.
    fn byte_level_char(byte: u8) -> char {
        let is_printable = matches!(byte, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        if is_printable {
            return char::from(byte);
        }
        let shifted = (0..byte)
            .filter(|b| !matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff))
            .count() as u32;
        char::from_u32(256 + shifted).unwrap()
    }

    fn byte_token_ids(tokenizer: &Tokenizer, bytes: &[u8]) -> Vec<u32> {
        bytes
            .iter()
            .map(|byte| {
                tokenizer
                    .token_to_id(&byte_level_char(*byte).to_string())
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn byte_level_tokens_splitting_a_character_are_held_until_complete() {
        let tokenizer = default_tokenizer();
        let mut ids = tokenizer.encode("A", false).unwrap().get_ids().to_vec();
        ids.extend(byte_token_ids(&tokenizer, "😀".as_bytes()));
        ids.extend(byte_token_ids(&tokenizer, "中".as_bytes()));
        ids.extend(tokenizer.encode("B", false).unwrap().get_ids());
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), "A😀中B");

        let mut detokenizer = IncrementalDetokenizer::new(tokenizer.clone(), true);
        let deltas: Vec<String> = ids
            .iter()
            .map(|id| detokenizer.push(&[*id]).unwrap())
            .collect();
        assert_eq!(deltas, ["A", "", "", "", "😀", "", "", "中", "B"]);
    }

    #[test]
    fn replacement_character_in_the_full_decode_is_streamed() {
        let tokenizer = default_tokenizer();
        // A lone lead byte followed by ASCII is invalid UTF-8 for good.
        let mut ids = byte_token_ids(&tokenizer, &[0xe4]);
        ids.extend(tokenizer.encode("ok", false).unwrap().get_ids());
        // A lead byte at the very end of the stream never completes.
        ids.extend(byte_token_ids(&tokenizer, &[0xf0, 0x9f]));
        let full = tokenizer.decode(&ids, true).unwrap();
        assert_eq!(full, "\u{FFFD}ok\u{FFFD}");
        let one_at_a_time: Vec<&[u32]> = ids.chunks(1).collect();
        assert_eq!(streamed_text(&tokenizer, &one_at_a_time, true, true), full);
    }

    #[test]
    fn special_tokens_are_skipped_or_kept_as_asked() {
        let tokenizer = default_tokenizer();
        let ids = tokenizer
            .encode("<|im_start|>assistant\nHi 👋🏽<|im_end|>", false)
            .unwrap()
            .get_ids()
            .to_vec();
        let one_at_a_time: Vec<&[u32]> = ids.chunks(1).collect();
        for skip in [true, false] {
            let full = tokenizer.decode(&ids, skip).unwrap();
            assert_eq!(streamed_text(&tokenizer, &one_at_a_time, skip, false), full);
        }
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), "assistant\nHi 👋🏽");
    }

    /// A SentencePiece-style tokenizer with byte fallback (like Llama 2's), small
    /// enough to spell out: characters missing from the vocabulary become
    /// `<0xNN>` byte tokens, and the decoder strips the leading space.
    fn byte_fallback_tokenizer() -> Arc<Tokenizer> {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<unk>".into(), 0.into());
        for byte in 0..=255u32 {
            vocab.insert(format!("<0x{byte:02X}>"), (byte + 1).into());
        }
        for (index, piece) in ["▁", "a", "b", "▁a", "é"].iter().enumerate() {
            vocab.insert((*piece).into(), (257 + index).into());
        }
        let config = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]},
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": [["▁", "a"]]
            }
        });
        Arc::new(config.to_string().parse::<Tokenizer>().unwrap())
    }

    #[test]
    fn byte_fallback_tokens_splitting_a_character_are_held_until_complete() {
        let tokenizer = byte_fallback_tokenizer();
        let ids = tokenizer
            .encode("a中é b🎉a", false)
            .unwrap()
            .get_ids()
            .to_vec();
        let byte_tokens = ids.iter().filter(|id| (1..=256).contains(*id)).count();
        assert_eq!(byte_tokens, 3 + 4, "中 and 🎉 fall back to bytes");
        let full = tokenizer.decode(&ids, true).unwrap();
        assert_eq!(full, "a中é b🎉a");

        let mut detokenizer = IncrementalDetokenizer::new(tokenizer.clone(), true);
        let mut deltas = Vec::new();
        for id in &ids {
            deltas.push(detokenizer.push(&[*id]).unwrap());
        }
        deltas.push(detokenizer.finish().unwrap());
        assert!(deltas.iter().all(|d| !d.contains(REPLACEMENT_CHARACTER)));
        assert!(deltas.contains(&"中".to_owned()));
        assert!(deltas.contains(&"🎉".to_owned()));
        assert_eq!(deltas.concat(), full);

        for split in 0..=ids.len() {
            let (head, tail) = ids.split_at(split);
            assert_eq!(streamed_text(&tokenizer, &[head, tail], true, false), full);
        }
    }
}
