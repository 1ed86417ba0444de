//! Long texts encoded in pieces, for a bounded peak of memory.
//!
//! While it encodes, the tokenizers crate holds about 150 bytes per byte of text: a normalized
//! string with per-byte alignments for every pre-token, then a string and offsets for every
//! token. One 4 MB prompt peaks near 600 MB, and a burst of them takes gigabytes. Encoded in
//! pieces of tens of KiB, each piece's state is freed before the next, and the ids are the same:
//! a piece ends only where the tokenizer itself starts a new pre-token, and nothing before the
//! pre-tokenizer (a normalizer, a stripping added token) looks across the cut.
//!
//! The cut: before a space that follows an ASCII letter or digit and precedes an ASCII letter
//! (`…d| word`). The byte-level regexes of GPT-2, Llama 3 and Qwen all end a pre-token there, and
//! a tokenizer is cut only after its own pre-tokenizer has been seen to do so on probes. Special
//! tokens that the post-processor adds (a BOS, an EOS) are added once, around the whole.

use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

/// Pieces of 16 KiB keep each piece's buffers (about 16 bytes of alignment per byte) below the
/// allocator's mapping threshold (`crate::allocator`), so that they are reused, not remapped.
pub const DEFAULT_PIECE_BYTES: usize = 16 * 1024;

/// Texts whose cut points are checked against the tokenizer's own pre-tokenizer.
const PROBES: [&str; 4] = [
    "ab cd",
    "a1 Bc de",
    "x.y7 z",
    "Hello world, 42 ways to say it",
];

pub struct PiecewiseEncoder {
    /// Pieces are at least this long (the last one may be shorter).
    piece_bytes: usize,
    /// The ids the post-processor adds before and after a text.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

impl PiecewiseEncoder {
    /// None when `tokenizer` could give other ids for pieces than for the whole: a normalizer,
    /// truncation or padding, an added token that spans or strips a space, a pre-tokenizer that
    /// does not start a pre-token at every cut of the probes, or a post-processor that does more
    /// than add fixed ids around the text.
    pub fn for_tokenizer(tokenizer: &Tokenizer, piece_bytes: usize) -> Option<Self> {
        assert!(piece_bytes > 0, "a piece holds at least one byte");
        if tokenizer.get_normalizer().is_some()
            || tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
        {
            return None;
        }
        let added = tokenizer.get_added_tokens_decoder();
        if added
            .values()
            .any(|token| token.rstrip || token.content.contains(' '))
        {
            return None;
        }
        let pre_tokenizer = tokenizer.get_pre_tokenizer()?;
        for probe in PROBES {
            let mut split = PreTokenizedString::from(probe);
            pre_tokenizer.pre_tokenize(&mut split).ok()?;
            let starts: Vec<usize> = split
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .iter()
                .map(|(_, (start, _), _)| *start)
                .collect();
            if !cuts(probe).all(|cut| starts.contains(&cut)) {
                return None;
            }
        }
        let (prefix, suffix) = added_around(tokenizer)?;
        Some(PiecewiseEncoder {
            piece_bytes,
            prefix,
            suffix,
        })
    }

    /// The ids of `text`, exactly as one `encode_fast` gives them.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        if text.len() <= self.piece_bytes {
            return Ok(tokenizer
                .encode_fast(text, add_special_tokens)?
                .get_ids()
                .to_vec());
        }
        let mut ids = Vec::new();
        if add_special_tokens {
            ids.extend_from_slice(&self.prefix);
        }
        for piece in pieces(text, self.piece_bytes) {
            ids.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
        }
        if add_special_tokens {
            ids.extend_from_slice(&self.suffix);
        }
        Ok(ids)
    }
}

/// The ids of `text`: in pieces with `piecewise`, else whole (the tokenizer cannot be cut, or
/// cutting is turned off). `encode_fast` either way: the same ids, without the offsets nobody
/// reads (a large share of a long prompt's transient memory).
pub fn encode_ids(
    piecewise: Option<&PiecewiseEncoder>,
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> tokenizers::Result<Vec<u32>> {
    match piecewise {
        Some(piecewise) => piecewise.encode(tokenizer, text, add_special_tokens),
        None => Ok(tokenizer
            .encode_fast(text, add_special_tokens)?
            .get_ids()
            .to_vec()),
    }
}

/// The post-processor's ids before and after a text: what `encode(.., true)` adds around
/// `encode(.., false)`; None if it changes more than that.
fn added_around(tokenizer: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let probe = PROBES[3];
    let bare = tokenizer.encode_fast(probe, false).ok()?.get_ids().to_vec();
    let full = tokenizer.encode_fast(probe, true).ok()?.get_ids().to_vec();
    let at = full
        .windows(bare.len())
        .position(|window| window == bare.as_slice())?;
    Some((full[..at].to_vec(), full[at + bare.len()..].to_vec()))
}

/// Byte offsets where `text` may be cut: a space after an ASCII letter or digit, before an
/// ASCII letter. ASCII bytes, so every cut is a char boundary.
fn cuts(text: &str) -> impl Iterator<Item = usize> + '_ {
    let bytes = text.as_bytes();
    (1..bytes.len().saturating_sub(1)).filter(move |&at| is_cut(bytes, at))
}

fn is_cut(bytes: &[u8], at: usize) -> bool {
    bytes[at] == b' '
        && bytes[at - 1].is_ascii_alphanumeric()
        && bytes[at + 1].is_ascii_alphabetic()
}

/// `text` in pieces of at least `piece_bytes`, each ending at the first cut after that; a
/// stretch with no cut stays whole.
fn pieces(text: &str, piece_bytes: usize) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start == bytes.len() {
            return None;
        }
        let earliest = start + piece_bytes;
        let end = (earliest..bytes.len().saturating_sub(1))
            .find(|&at| is_cut(bytes, at))
            .unwrap_or(bytes.len());
        let piece = &text[start..end];
        start = end;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::default_model::{default_model_dir, load_default_model_tokenizer};

    /// Varied text with every kind of place a cut could go wrong: runs of spaces, newlines,
    /// digits, punctuation, non-ASCII letters, emoji and special tokens.
    fn varied_text(seed: u64, words: usize) -> String {
        const PARTS: [&str; 24] = [
            "river",
            "Ab",
            "x",
            "42",
            "7",
            "é",
            "naïve",
            "世界",
            "👋🏽",
            ".",
            ",",
            "!?",
            "'s",
            "'ll",
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "don't",
            "a1",
            "Q",
            "\t",
            "ü",
            "--",
            "_",
        ];
        const GAPS: [&str; 6] = [" ", " ", " ", "  ", "\n", ""];
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut next = move |n: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as usize) % n
        };
        let mut text = String::new();
        for _ in 0..words {
            text.push_str(PARTS[next(PARTS.len())]);
            text.push_str(GAPS[next(GAPS.len())]);
        }
        text
    }

    fn tokenizer_with(edit: impl FnOnce(&mut serde_json::Value)) -> Tokenizer {
        let path = default_model_dir().join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        edit(&mut json);
        json.to_string().parse().unwrap()
    }

    fn assert_same_ids(tokenizer: &Tokenizer, encoder: &PiecewiseEncoder, text: &str) {
        for add_special_tokens in [false, true] {
            let whole = tokenizer.encode_fast(text, add_special_tokens).unwrap();
            let pieced = encoder.encode(tokenizer, text, add_special_tokens).unwrap();
            assert_eq!(
                pieced,
                whole.get_ids(),
                "add_special_tokens {add_special_tokens}, text {text:?}"
            );
        }
    }

    #[test]
    fn pieces_give_the_whole_texts_ids_for_the_default_model() {
        let tokenizer = load_default_model_tokenizer();
        // Pieces of a few bytes put a cut at nearly every possible place.
        for piece_bytes in [1, 3, 16, 200] {
            let encoder = PiecewiseEncoder::for_tokenizer(&tokenizer, piece_bytes).unwrap();
            for seed in 0..20 {
                let text = varied_text(seed, 400);
                assert!(pieces(&text, piece_bytes).count() > 1);
                assert_same_ids(&tokenizer, &encoder, &text);
            }
        }
    }

    #[test]
    fn pieces_give_the_whole_texts_ids_under_llama_3s_pre_tokenizer() {
        // Llama 3's (and, but for digit runs, Qwen 2's) split regex before the byte mapping.
        let pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let tokenizer = tokenizer_with(|json| {
            json["pre_tokenizer"] = serde_json::json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
                ]
            });
        });
        let encoder = PiecewiseEncoder::for_tokenizer(&tokenizer, 3).unwrap();
        for seed in 0..20 {
            assert_same_ids(&tokenizer, &encoder, &varied_text(seed, 400));
        }
    }

    #[test]
    fn a_bos_and_an_eos_from_the_post_processor_are_added_once_around_the_whole() {
        let tokenizer = tokenizer_with(|json| {
            json["post_processor"] = serde_json::json!({
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
                ],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {
                    "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
                    "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
                }
            });
        });
        let encoder = PiecewiseEncoder::for_tokenizer(&tokenizer, 8).unwrap();
        assert_eq!(
            (encoder.prefix.as_slice(), encoder.suffix.as_slice()),
            (&[1][..], &[0][..])
        );
        for seed in 0..5 {
            assert_same_ids(&tokenizer, &encoder, &varied_text(seed, 200));
        }
    }

    #[test]
    fn tokenizers_that_could_change_at_a_cut_are_encoded_whole() {
        let normalized = tokenizer_with(|json| {
            json["normalizer"] = serde_json::json!({"type": "Lowercase"});
        });
        // A pre-tokenizer that keeps "ab cd" in one pre-token (only bytes mapped, no regex).
        let unsplit = tokenizer_with(|json| {
            json["pre_tokenizer"] = serde_json::json!({
                "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false
            });
        });
        let stripping = tokenizer_with(|json| {
            json["added_tokens"][0]["rstrip"] = serde_json::json!(true);
        });
        for tokenizer in [normalized, unsplit, stripping] {
            assert!(PiecewiseEncoder::for_tokenizer(&tokenizer, 8).is_none());
        }
    }

    #[test]
    fn a_text_without_a_cut_is_one_piece() {
        let text = "x".repeat(100) + " " + &"7".repeat(50);
        assert_eq!(pieces(&text, 10).collect::<Vec<_>>(), vec![text.as_str()]);
        let cut = "aa bb cc dd";
        assert_eq!(pieces(cut, 4).collect::<Vec<_>>(), vec!["aa bb", " cc dd"]);
        assert_eq!(
            pieces(cut, 1).collect::<Vec<_>>(),
            vec!["aa", " bb", " cc", " dd"]
        );
    }
}
