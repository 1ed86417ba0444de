//! Tokenization off the async executor.
//!
//! Encoding a long prompt takes milliseconds of CPU; done inside a tokio task it
//! would stall every other connection on that executor thread. As in TGI, a few
//! dedicated OS threads own the tokenizer and take jobs from a bounded queue;
//! each job answers on its own oneshot channel.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread;

use sluice_common::text::tokenizer_file::LoadTokenizerError;
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::text::detokenizer::IncrementalDetokenizer;
use sluice_common::text::piecewise_encoder::{encode_ids, PiecewiseEncoder};

type Job = Box<dyn FnOnce(&Tokenizer) + Send>;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerPoolError {
    #[error(transparent)]
    Load(#[from] LoadTokenizerError),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
    #[error("the tokenizer pool has shut down")]
    Closed,
    #[error("a tokenizer job panicked")]
    JobPanicked,
    /// The engine takes a pair's token types as the one position where type 1 starts.
    #[error(
        "the tokenizer's pair template types a pair's tokens {0}, which this server cannot pass \
         to the engine: it passes type 0 up to one position and type 1 from there on"
    )]
    PairTyping(String),
}

/// A cross-encoder's prompt: a pair of texts tokenized as one by the tokenizer's pair template
/// (`[CLS] A [SEP] B [SEP]` for BERT, `<s> A </s></s> B </s>` for XLM-RoBERTa), special tokens and
/// all, with the token types the template gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairPrompt {
    pub token_ids: Vec<u32>,
    /// Where token type 1 starts and goes on to the end (BERT's template: at the second text's
    /// first token); None: type 0 throughout (XLM-RoBERTa's template).
    pub second_text_start: Option<u32>,
    /// The tokens of each text of its own, without the template's special tokens.
    pub text_tokens: [usize; 2],
}

/// A handle to the worker threads; clones share the same workers. The workers
/// exit once every handle is dropped and the queue is drained.
#[derive(Clone)]
pub struct TokenizerPool {
    jobs: mpsc::Sender<Job>,
    tokenizer: Arc<Tokenizer>,
    /// Long texts in pieces; None: whole (turned off, or a tokenizer that cannot be cut exactly).
    piecewise: Option<Arc<PiecewiseEncoder>>,
}

impl TokenizerPool {
    /// Starts `workers` threads; at most `queue_depth` jobs wait for a worker
    /// before callers are made to wait in turn. Texts longer than `piece_bytes` are encoded in
    /// pieces of that size where the tokenizer allows it exactly; 0 encodes every text whole.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        workers: usize,
        queue_depth: usize,
        piece_bytes: usize,
    ) -> Self {
        assert!(
            workers > 0 && queue_depth > 0,
            "pool needs workers and a queue"
        );
        let (jobs, receiver) = mpsc::channel::<Job>(queue_depth);
        // One shared receiver makes an idle worker take the next job, so a long
        // encode never queues short jobs behind it while another worker is free.
        let receiver = Arc::new(Mutex::new(receiver));
        for index in 0..workers {
            let receiver = receiver.clone();
            let tokenizer = tokenizer.clone();
            thread::Builder::new()
                .name(format!("sluice-tokenizer-{index}"))
                .spawn(move || run_worker(&tokenizer, &receiver))
                .expect("spawning a tokenizer thread");
        }
        let piecewise = (piece_bytes > 0)
            .then(|| PiecewiseEncoder::for_tokenizer(&tokenizer, piece_bytes))
            .flatten()
            .map(Arc::new);
        Self {
            jobs,
            tokenizer,
            piecewise,
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Runs `job` with the tokenizer on a worker thread and returns its result.
    pub async fn run<T, F>(&self, job: F) -> Result<T, TokenizerPoolError>
    where
        F: FnOnce(&Tokenizer) -> T + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |tokenizer| {
            // The caller may have gone away (client disconnect); nothing to do then.
            let _ = reply.send(job(tokenizer));
        });
        self.jobs
            .send(job)
            .await
            .map_err(|_| TokenizerPoolError::Closed)?;
        // The reply sender is dropped unanswered only when the job panicked.
        answer.await.map_err(|_| TokenizerPoolError::JobPanicked)
    }

    pub async fn encode(
        &self,
        text: String,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerPoolError> {
        let piecewise = self.piecewise.clone();
        self.run(move |tokenizer| {
            encode_ids(piecewise.as_deref(), tokenizer, &text, add_special_tokens)
                .map_err(|error| TokenizerPoolError::Tokenizer(error.to_string()))
        })
        .await?
    }

    /// The pair `(first, second)` as one prompt (see [`PairPrompt`]).
    pub async fn encode_pair(
        &self,
        first: String,
        second: String,
    ) -> Result<PairPrompt, TokenizerPoolError> {
        self.run(move |tokenizer| pair_prompt(tokenizer, &first, &second))
            .await?
    }

    pub async fn decode(
        &self,
        ids: Vec<u32>,
        skip_special_tokens: bool,
    ) -> Result<String, TokenizerPoolError> {
        self.run(move |tokenizer| {
            tokenizer
                .decode(&ids, skip_special_tokens)
                .map_err(|error| TokenizerPoolError::Tokenizer(error.to_string()))
        })
        .await?
    }

    /// Feeds new ids to a stream's detokenizer on a worker; the detokenizer comes
    /// back with the text delta.
    pub async fn detokenize(
        &self,
        mut detokenizer: IncrementalDetokenizer,
        new_ids: Vec<u32>,
    ) -> Result<(IncrementalDetokenizer, String), TokenizerPoolError> {
        self.run(move |_| {
            let delta = detokenizer
                .push(&new_ids)
                .map_err(|error| TokenizerPoolError::Tokenizer(error.to_string()))?;
            Ok((detokenizer, delta))
        })
        .await?
    }
}

fn pair_prompt(
    tokenizer: &Tokenizer,
    first: &str,
    second: &str,
) -> Result<PairPrompt, TokenizerPoolError> {
    // Whole: the piecewise encoder cuts one text, and a cross-encoder's context is short anyway.
    let encoding = tokenizer
        .encode_fast((first, second), true)
        .map_err(|error| TokenizerPoolError::Tokenizer(error.to_string()))?;
    let type_ids = encoding.get_type_ids();
    let second_text_start = second_text_start(type_ids)
        .ok_or_else(|| TokenizerPoolError::PairTyping(type_runs(type_ids)))?;
    let mut text_tokens = [0; 2];
    for sequence in encoding.get_sequence_ids().into_iter().flatten() {
        text_tokens[sequence] += 1;
    }
    Ok(PairPrompt {
        token_ids: encoding.get_ids().to_vec(),
        second_text_start,
        text_tokens,
    })
}

/// Where type 1 starts in types of the form 0…0 1…1, None when all are 0; no answer (the outer
/// None) for types of any other form, which one position cannot pass on.
fn second_text_start(type_ids: &[u32]) -> Option<Option<u32>> {
    let start = type_ids
        .iter()
        .position(|&type_id| type_id != 0)
        .unwrap_or(type_ids.len());
    type_ids[start..]
        .iter()
        .all(|&type_id| type_id == 1)
        .then(|| (start < type_ids.len()).then_some(start as u32))
}

/// Token types as their runs, `[0 ×4, 1 ×3, 0 ×1]`: a long prompt's whole list says no more.
fn type_runs(type_ids: &[u32]) -> String {
    let runs: Vec<String> = type_ids
        .chunk_by(|a, b| a == b)
        .map(|run| format!("{} ×{}", run[0], run.len()))
        .collect();
    format!("[{}]", runs.join(", "))
}

fn run_worker(tokenizer: &Tokenizer, receiver: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = {
            // A poisoned lock only means another worker panicked while waiting;
            // the receiver itself is still sound.
            let mut receiver = receiver.lock().unwrap_or_else(|e| e.into_inner());
            receiver.blocking_recv()
        };
        let Some(job) = job else { return };
        // A panicking job must not take the worker down with it; its caller sees
        // the dropped reply channel as `JobPanicked`.
        let _ = catch_unwind(AssertUnwindSafe(|| job(tokenizer)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::text::default_model::load_default_model_tokenizer;

    fn default_pool(workers: usize) -> TokenizerPool {
        TokenizerPool::new(Arc::new(load_default_model_tokenizer()), workers, 16, 0)
    }

    /// A word-level tokenizer of a few words whose pair template is `pair`, in the tokenizers
    /// library's notation (`[CLS] $A [SEP] $B:1 [SEP]:1`).
    fn pair_tokenizer(pair: &str) -> Tokenizer {
        let vocab = serde_json::json!({
            "[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "<s>": 3, "</s>": 4,
            "what": 5, "is": 6, "a": 7, "dog": 8,
        });
        let piece = |item: &str| {
            let (name, type_id) = item.split_once(':').unwrap_or((item, "0"));
            let type_id: u32 = type_id.parse().unwrap();
            match name.strip_prefix('$') {
                Some(sequence) => {
                    serde_json::json!({"Sequence": {"id": sequence, "type_id": type_id}})
                }
                None => serde_json::json!({"SpecialToken": {"id": name, "type_id": type_id}}),
            }
        };
        let special = |token: &str| {
            let id = vocab[token].as_u64().unwrap();
            serde_json::json!({"id": token, "ids": [id], "tokens": [token]})
        };
        let config = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [piece("$A")],
                "pair": pair.split(' ').map(piece).collect::<Vec<_>>(),
                "special_tokens": {
                    "[CLS]": special("[CLS]"), "[SEP]": special("[SEP]"),
                    "<s>": special("<s>"), "</s>": special("</s>"),
                },
            },
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        config.to_string().parse().unwrap()
    }

    #[test]
    fn bert_types_the_second_text_and_its_sep_1_from_its_first_token() {
        let tokenizer = pair_tokenizer("[CLS] $A [SEP] $B:1 [SEP]:1");
        let pair = pair_prompt(&tokenizer, "what is", "a dog").unwrap();
        assert_eq!(
            pair,
            PairPrompt {
                token_ids: vec![1, 5, 6, 2, 7, 8, 2],
                second_text_start: Some(4),
                text_tokens: [2, 2],
            }
        );
    }

    #[test]
    fn xlm_roberta_types_everything_0() {
        let tokenizer = pair_tokenizer("<s> $A </s> </s> $B </s>");
        let pair = pair_prompt(&tokenizer, "what is", "a dog").unwrap();
        assert_eq!(
            pair,
            PairPrompt {
                token_ids: vec![3, 5, 6, 4, 4, 7, 8, 4],
                second_text_start: None,
                text_tokens: [2, 2],
            }
        );
    }

    #[test]
    fn types_that_one_start_cannot_pass_are_refused() {
        // Type 1 for the second text only, its closing separator back to 0.
        let tokenizer = pair_tokenizer("[CLS] $A [SEP] $B:1 [SEP]");
        let error = pair_prompt(&tokenizer, "what is", "a dog").unwrap_err();
        assert!(matches!(error, TokenizerPoolError::PairTyping(_)));
        assert!(
            error.to_string().starts_with(
                "the tokenizer's pair template types a pair's tokens [0 ×4, 1 ×2, 0 ×1]"
            ),
            "{error}"
        );
        // A third type is no more one start of type 1.
        assert_eq!(second_text_start(&[0, 0, 2, 2]), None);
        assert_eq!(second_text_start(&[0, 1, 1]), Some(Some(1)));
        assert_eq!(second_text_start(&[1, 1]), Some(Some(0)));
        assert_eq!(second_text_start(&[]), Some(None));
    }

    #[tokio::test]
    async fn a_pair_is_encoded_on_the_pool_and_its_typing_error_is_the_pools() {
        let pool = |pair| TokenizerPool::new(Arc::new(pair_tokenizer(pair)), 1, 4, 0);
        let bert = pool("[CLS] $A [SEP] $B:1 [SEP]:1");
        let pair = bert.encode_pair("dog".into(), "what".into()).await.unwrap();
        assert_eq!(
            (pair.token_ids, pair.second_text_start),
            (vec![1, 8, 2, 5, 2], Some(3))
        );
        let odd = pool("$A:1 $B:0");
        assert!(matches!(
            odd.encode_pair("dog".into(), "what".into()).await,
            Err(TokenizerPoolError::PairTyping(_))
        ));
    }

    #[tokio::test]
    async fn encode_and_decode_match_the_tokenizer() {
        let pool = default_pool(2);
        let text = "<|im_start|>user\nHello, 世界 👋🏽!<|im_end|>\n";
        let ids = pool.encode(text.to_owned(), true).await.unwrap();
        let direct = pool.tokenizer().encode(text, true).unwrap();
        assert_eq!(ids, direct.get_ids());
        assert_eq!(
            ids[0],
            pool.tokenizer().token_to_id("<|im_start|>").unwrap()
        );

        assert_eq!(pool.decode(ids.clone(), false).await.unwrap(), text);
        assert_eq!(
            pool.decode(ids, true).await.unwrap(),
            "user\nHello, 世界 👋🏽!\n"
        );
    }

    #[tokio::test]
    async fn special_token_text_maps_to_its_id_with_or_without_special_tokens() {
        let pool = default_pool(1);
        let with = pool.encode("<|im_end|>".into(), true).await.unwrap();
        let without = pool.encode("<|im_end|>".into(), false).await.unwrap();
        assert_eq!(with, [pool.tokenizer().token_to_id("<|im_end|>").unwrap()]);
        // Added tokens in the text match either way; the flag only asks the
        // post-processor for BOS/EOS, which this model's tokenizer does not add.
        assert_eq!(with, without);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_concurrent_jobs_all_get_their_own_answer() {
        let pool = default_pool(3);
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let text = format!("request number {i}: {}", "日本語 ".repeat(i % 7));
                    let ids = pool.encode(text.clone(), false).await.unwrap();
                    (text, pool.decode(ids, false).await.unwrap())
                })
            })
            .collect();
        for task in tasks {
            let (sent, decoded) = task.await.unwrap();
            assert_eq!(sent, decoded);
        }
    }

    #[tokio::test]
    async fn detokenize_streams_through_the_pool() {
        let pool = default_pool(2);
        let text = "Streaming 🏳️‍🌈 text, 中文, e\u{301}.";
        let ids = pool.encode(text.into(), false).await.unwrap();
        let mut detokenizer = IncrementalDetokenizer::new(pool.tokenizer().clone(), true);
        let mut streamed = String::new();
        for id in ids {
            let (next, delta) = pool.detokenize(detokenizer, vec![id]).await.unwrap();
            detokenizer = next;
            streamed.push_str(&delta);
        }
        streamed.push_str(&detokenizer.finish().unwrap());
        assert_eq!(streamed, text);
    }

    #[tokio::test]
    async fn a_panicking_job_is_reported_and_the_worker_survives() {
        let pool = default_pool(1);
        let result = pool.run(|_| -> u32 { panic!("boom") }).await;
        assert!(matches!(result, Err(TokenizerPoolError::JobPanicked)));
        assert_eq!(pool.decode(vec![], true).await.unwrap(), "");
        let ids = pool.encode("still alive".into(), false).await.unwrap();
        assert!(!ids.is_empty());
    }
}
