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
