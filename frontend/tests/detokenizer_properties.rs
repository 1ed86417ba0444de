//! Arbitrary token id sequences, split into arbitrary chunks, through the incremental detokenizer
//! with the default model's tokenizer: never a panic, and the streamed deltas joined equal the
//! whole sequence decoded at once (or both fail).

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use sluice_common::text::default_model::default_model_dir;
use sluice_common::text::tokenizer_file::load_tokenizer;
use sluice_frontend::text::detokenizer::IncrementalDetokenizer;
use tokenizers::Tokenizer;

fn tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            Arc::new(load_tokenizer(&default_model_dir()).expect("the tokenizer loads"))
        })
        .clone()
}

/// Token ids weighted towards the byte-level tokens and special tokens at the bottom of the
/// vocabulary, where characters get split, with some ids past its end.
fn token_ids() -> impl Strategy<Value = Vec<u32>> {
    let vocab = tokenizer().get_vocab_size(true) as u32;
    let id = prop_oneof![4 => 0..vocab, 3 => 0u32..300, 1 => vocab..vocab + 100];
    prop::collection::vec(id, 0..40)
}

/// The deltas of streaming `ids` in chunks of the given sizes (cycled), then finishing.
fn streamed(
    ids: &[u32],
    chunk_sizes: &[usize],
    skip_special_tokens: bool,
) -> Result<String, String> {
    let mut detokenizer = IncrementalDetokenizer::new(tokenizer(), skip_special_tokens);
    let mut text = String::new();
    let mut rest = ids;
    for &size in chunk_sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (chunk, after) = rest.split_at(size.min(rest.len()));
        text += &detokenizer.push(chunk).map_err(|e| e.to_string())?;
        rest = after;
    }
    text += &detokenizer.finish().map_err(|e| e.to_string())?;
    Ok(text)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn streamed_deltas_join_to_the_whole_decode(
        ids in token_ids(),
        chunk_sizes in prop::collection::vec(1usize..5, 1..6),
        skip_special_tokens in any::<bool>(),
    ) {
        let whole = tokenizer().decode(&ids, skip_special_tokens).map_err(|e| e.to_string());
        let streamed = streamed(&ids, &chunk_sizes, skip_special_tokens);
        match (whole, streamed) {
            (Ok(whole), Ok(streamed)) => prop_assert_eq!(streamed, whole),
            (Err(_), Err(_)) => {}
            (whole, streamed) => prop_assert!(false, "whole {:?} vs streamed {:?}", whole, streamed),
        }
    }
}
