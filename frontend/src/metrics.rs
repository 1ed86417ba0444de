//! Prometheus metrics, named as vLLM names them, under the prefix `sluice:` or, with
//! `--metrics-prefix vllm`, `vllm:`, so that vLLM's Grafana dashboard works unchanged.
//!
//! Request metrics are atomics that each engine request's [`RequestMetrics`] updates as its
//! outputs arrive; the engine's own gauges, counters and the `iteration_tokens` histogram arrive
//! with its output batches as [`EngineStats`], and are rendered as they were last reported.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::engine::protocol::{EngineStats, FinishReason, ITERATION_TOKENS_BOUNDS};
use crate::response_store::StoreStats;

/// Latency buckets in seconds, from vLLM's choices for the same histograms.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0,
];
/// Token-count buckets, 1-2-5 steps as vLLM's.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

/// The namespace of every metric name: ours, or vLLM's for dashboards built for vLLM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsPrefix {
    #[default]
    Sluice,
    Vllm,
}

impl MetricsPrefix {
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsPrefix::Sluice => "sluice",
            MetricsPrefix::Vllm => "vllm",
        }
    }
}

/// A cumulative histogram with fixed buckets. The sum is kept under a small lock: f64 has no atomic add.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_and_count: Mutex<(f64, u64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_and_count: Mutex::new((0.0, 0)),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        let mut guard = self.sum_and_count.lock().expect("histogram lock poisoned");
        guard.0 += value;
        guard.1 += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let (sum, count) = *self.sum_and_count.lock().expect("histogram lock poisoned");
        let buckets = self.bounds.iter().copied().zip(
            self.counts
                .iter()
                .map(|count| count.load(Ordering::Relaxed)),
        );
        render_histogram(out, name, help, labels, buckets, sum, count);
    }
}

/// One histogram in the text exposition, from its per-bucket (not cumulative) counts; `count`
/// includes the observations above the last bound.
fn render_histogram(
    out: &mut String,
    name: &str,
    help: &str,
    labels: &str,
    buckets: impl Iterator<Item = (f64, u64)>,
    sum: f64,
    count: u64,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cumulative = 0;
    for (bound, in_bucket) in buckets {
        cumulative += in_bucket;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
    }
    debug_assert!(cumulative <= count);
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
}

pub struct Metrics {
    prefix: MetricsPrefix,
    model_name: String,
    /// The CPU kernels' tier, for the cpu_kernels_info gauge; None renders no such gauge.
    cpu_kernels: Option<String>,
    /// One counter per finish reason, in `FinishReason::ALL`'s order.
    request_success: [AtomicU64; FinishReason::ALL.len()],
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_request_latency: Histogram,
    request_queue_time: Histogram,
    request_prefill_time: Histogram,
    request_decode_time: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    request_max_num_generation_tokens: Histogram,
}

impl Metrics {
    pub fn new(model_name: impl Into<String>, prefix: MetricsPrefix) -> Self {
        Metrics {
            prefix,
            model_name: model_name.into(),
            cpu_kernels: None,
            request_success: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_BUCKETS),
            request_queue_time: Histogram::new(REQUEST_BUCKETS),
            request_prefill_time: Histogram::new(REQUEST_BUCKETS),
            request_decode_time: Histogram::new(REQUEST_BUCKETS),
            request_prompt_tokens: Histogram::new(TOKEN_BUCKETS),
            request_generation_tokens: Histogram::new(TOKEN_BUCKETS),
            request_max_num_generation_tokens: Histogram::new(TOKEN_BUCKETS),
        }
    }

    /// Renders `cpu_kernels_info{tier="..."} 1`, the tier of the CPU kernels the engine's workers run.
    pub fn with_cpu_kernels(mut self, tier: String) -> Self {
        self.cpu_kernels = Some(tier);
        self
    }

    /// What the `choices` engine requests of one prompt share: `prompt_tokens` counts once.
    pub fn prompt(&self, prompt_tokens: u64, choices: usize) -> Arc<PromptShare> {
        assert!(choices > 0, "a prompt has at least one choice");
        Arc::new(PromptShare {
            prompt_tokens,
            counted: AtomicBool::new(false),
            choices_left: AtomicUsize::new(choices),
            max_generation_tokens: AtomicU64::new(0),
        })
    }

    /// The Prometheus text exposition of every metric, with the engine's as `engine` reported them.
    /// The response store's gauges and eviction counters (`/v1/responses`).
    pub fn render_store(&self, store: &StoreStats) -> String {
        let prefix = self.prefix.as_str();
        let labels = format!("model_name=\"{}\"", escape_label(&self.model_name));
        let mut out = String::with_capacity(1024);
        for (name, help, value) in [
            (
                "responses_stored",
                "Responses kept for previous_response_id.",
                store.stored,
            ),
            (
                "responses_stored_bytes",
                "Bytes of the responses kept.",
                store.bytes,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {prefix}:{name} {help}\n# TYPE {prefix}:{name} gauge\n{prefix}:{name}{{{labels}}} {value}"
            );
        }
        let name = format!("{prefix}:responses_evicted_total");
        let _ = writeln!(
            out,
            "# HELP {name} Stored responses dropped: the oldest past --responses-store-max-mb \
             (size), or older than --responses-store-max-age-s (age).\n# TYPE {name} counter\n\
             {name}{{{labels},reason=\"size\"}} {}\n{name}{{{labels},reason=\"age\"}} {}",
            store.evicted_for_size, store.evicted_for_age
        );
        out
    }

    /// `engine_restarts` counts the engine cores that took over after one was lost.
    pub fn render(&self, engine: &EngineStats, engine_restarts: u64) -> String {
        let prefix = self.prefix.as_str();
        let labels = format!("model_name=\"{}\"", escape_label(&self.model_name));
        let mut out = String::with_capacity(16384);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {prefix}:{name} {help}\n# TYPE {prefix}:{name} {kind}\n{prefix}:{name}{{{labels}}} {value}"
            );
        };
        metric(
            "num_requests_running",
            "gauge",
            "Requests in the running batch.",
            engine.num_running.to_string(),
        );
        metric(
            "num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            engine.num_waiting.to_string(),
        );
        metric(
            "kv_cache_usage_perc",
            "gauge",
            "Fraction of KV cache blocks in use (1 = full).",
            engine.kv_cache_usage.to_string(),
        );
        metric(
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            engine.prefix_cache_queries.to_string(),
        );
        metric(
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            engine.prefix_cache_hits.to_string(),
        );
        metric(
            "num_preemptions_total",
            "counter",
            "Requests preempted by the scheduler.",
            engine.num_preemptions.to_string(),
        );
        metric(
            "graph_eager_fallbacks_total",
            "counter",
            "Engine steps that graphs were on for but that ran eagerly because no captured graph shape fit them.",
            engine.num_eager_fallbacks.to_string(),
        );
        metric(
            "spec_decode_num_drafts_total",
            "counter",
            "Speculative decoding: request steps that verified draft tokens.",
            engine.spec_decode_num_drafts.to_string(),
        );
        metric(
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative decoding: draft tokens verified.",
            engine.spec_decode_num_draft_tokens.to_string(),
        );
        metric(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens accepted (acceptance rate = accepted / draft tokens).",
            engine.spec_decode_num_accepted_tokens.to_string(),
        );
        metric(
            "engine_restarts_total",
            "counter",
            "Times a restarted engine core took over after the engine core was lost.",
            engine_restarts.to_string(),
        );
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled, once per prompt whatever its number of choices.",
            self.prompt_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "generation_tokens_total",
            "counter",
            "Generated tokens, counted as they arrive from the engine.",
            self.generation_tokens.load(Ordering::Relaxed).to_string(),
        );
        let name = format!("{prefix}:request_success_total");
        let _ = writeln!(
            out,
            "# HELP {name} Finished requests by finish reason.\n# TYPE {name} counter"
        );
        for (reason, count) in FinishReason::ALL.iter().zip(&self.request_success) {
            let _ = writeln!(
                out,
                "{name}{{{labels},finished_reason=\"{}\"}} {}",
                reason.as_str(),
                count.load(Ordering::Relaxed)
            );
        }
        if let Some(tier) = &self.cpu_kernels {
            let name = format!("{prefix}:cpu_kernels_info");
            let _ = writeln!(
                out,
                "# HELP {name} The instruction-set tier of the CPU kernels the workers run (none: torch's own ops).\n\
                 # TYPE {name} gauge\n{name}{{{labels},tier=\"{}\"}} 1",
                escape_label(tier)
            );
        }
        let histograms = [
            (
                &self.time_to_first_token,
                "time_to_first_token_seconds",
                "Time from arrival to the first token.",
            ),
            (
                &self.inter_token_latency,
                "inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
            ),
            (
                &self.e2e_request_latency,
                "e2e_request_latency_seconds",
                "Time from arrival to the end of the request.",
            ),
            (
                &self.request_queue_time,
                "request_queue_time_seconds",
                "Time from arrival until the engine first scheduled the request.",
            ),
            (
                &self.request_prefill_time,
                "request_prefill_time_seconds",
                "Time from the first schedule to the first token.",
            ),
            (
                &self.request_decode_time,
                "request_decode_time_seconds",
                "Time from the first token to the end of the request.",
            ),
            (
                &self.request_prompt_tokens,
                "request_prompt_tokens",
                "Prompt tokens per prompt, observed when its prefill is done.",
            ),
            (
                &self.request_generation_tokens,
                "request_generation_tokens",
                "Generated tokens per finished engine request.",
            ),
            (
                &self.request_max_num_generation_tokens,
                "request_max_num_generation_tokens",
                "The most tokens any choice of a prompt generated, once all its choices ended.",
            ),
        ];
        for (histogram, name, help) in histograms {
            histogram.render(&mut out, &format!("{prefix}:{name}"), help, &labels);
        }
        let counts = |i: usize| engine.iteration_tokens.get(i).copied().unwrap_or(0);
        render_histogram(
            &mut out,
            // vLLM's name, `_total` and all, although it is a histogram.
            &format!("{prefix}:iteration_tokens_total"),
            "Tokens computed per engine step.",
            &labels,
            ITERATION_TOKENS_BOUNDS
                .iter()
                .enumerate()
                .map(|(i, &bound)| (bound as f64, counts(i))),
            engine.iteration_tokens_sum as f64,
            engine.iteration_tokens.iter().sum(),
        );
        out
    }
}

/// What the choices of one prompt share: its prompt counts once, and its longest choice is
/// observed once all of them have ended.
pub struct PromptShare {
    prompt_tokens: u64,
    counted: AtomicBool,
    choices_left: AtomicUsize,
    max_generation_tokens: AtomicU64,
}

/// One engine request's timing and token counts, recorded into [`Metrics`] as its outputs arrive.
pub struct RequestMetrics {
    metrics: Arc<Metrics>,
    prompt: Arc<PromptShare>,
    arrival: Instant,
    /// `arrival` on the wall clock that the engine's first-schedule time is read against.
    arrival_time: f64,
    queue_time: Option<f64>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    generation_tokens: u64,
    finished: bool,
}

impl RequestMetrics {
    pub fn new(
        metrics: Arc<Metrics>,
        prompt: Arc<PromptShare>,
        arrival: Instant,
        arrival_time: f64,
    ) -> Self {
        RequestMetrics {
            metrics,
            prompt,
            arrival,
            arrival_time,
            queue_time: None,
            first_token_at: None,
            last_token_at: None,
            generation_tokens: 0,
            finished: false,
        }
    }

    /// Records one engine output: `new_tokens` tokens, and when the engine first scheduled it.
    pub fn on_output(&mut self, new_tokens: usize, first_scheduled_time: Option<f64>) {
        let now = Instant::now();
        let since_arrival = (now - self.arrival).as_secs_f64();
        let metrics = &self.metrics;
        if let (None, Some(scheduled)) = (self.queue_time, first_scheduled_time) {
            // Two clocks of one machine: clamped so that queue time never exceeds what we saw pass.
            let queue = (scheduled - self.arrival_time).clamp(0.0, since_arrival);
            metrics.request_queue_time.observe(queue);
            self.queue_time = Some(queue);
        }
        if new_tokens == 0 {
            return;
        }
        self.generation_tokens += new_tokens as u64;
        metrics
            .generation_tokens
            .fetch_add(new_tokens as u64, Ordering::Relaxed);
        match self.last_token_at {
            None => {
                metrics.time_to_first_token.observe(since_arrival);
                if let Some(queue) = self.queue_time {
                    metrics.request_prefill_time.observe(since_arrival - queue);
                }
                self.count_prompt();
                self.first_token_at = Some(now);
            }
            Some(last) => metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        self.last_token_at = Some(now);
    }

    /// Records a pooling request's embedding: its prompt was prefilled, and no token follows.
    pub fn on_embedding(&mut self) {
        self.count_prompt();
    }

    /// Counts the prompt once it is prefilled, once for all its choices.
    fn count_prompt(&self) {
        if !self.prompt.counted.swap(true, Ordering::Relaxed) {
            let prompt_tokens = self.prompt.prompt_tokens;
            let metrics = &self.metrics;
            metrics
                .prompt_tokens
                .fetch_add(prompt_tokens, Ordering::Relaxed);
            metrics.request_prompt_tokens.observe(prompt_tokens as f64);
        }
    }

    /// Records the request's end; only the first call counts.
    pub fn on_finish(&mut self, finish_reason: FinishReason) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let metrics = &self.metrics;
        let index = FinishReason::ALL
            .iter()
            .position(|&r| r == finish_reason)
            .expect("every reason is in ALL");
        metrics.request_success[index].fetch_add(1, Ordering::Relaxed);
        metrics
            .e2e_request_latency
            .observe(self.arrival.elapsed().as_secs_f64());
        if let Some(first) = self.first_token_at {
            metrics
                .request_decode_time
                .observe(first.elapsed().as_secs_f64());
        }
        metrics
            .request_generation_tokens
            .observe(self.generation_tokens as f64);
        let prompt = &self.prompt;
        prompt
            .max_generation_tokens
            .fetch_max(self.generation_tokens, Ordering::Relaxed);
        if prompt.choices_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let longest = prompt.max_generation_tokens.load(Ordering::Relaxed);
            metrics
                .request_max_num_generation_tokens
                .observe(longest as f64);
        }
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> &'a str {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting {prefix}"))
    }

    fn value(text: &str, prefix: &str) -> f64 {
        let found = line(text, prefix);
        found[prefix.len()..].trim().parse().unwrap()
    }

    fn metrics() -> Arc<Metrics> {
        Arc::new(Metrics::new("m", MetricsPrefix::Sluice))
    }

    #[test]
    fn the_response_store_is_two_gauges_and_evictions_by_reason() {
        let text = Metrics::new("m", MetricsPrefix::Sluice).render_store(&StoreStats {
            stored: 3,
            bytes: 300,
            evicted_for_size: 2,
            evicted_for_age: 1,
        });
        assert_eq!(
            line(&text, "sluice:responses_stored{"),
            "sluice:responses_stored{model_name=\"m\"} 3"
        );
        assert_eq!(
            line(&text, "sluice:responses_stored_bytes{"),
            "sluice:responses_stored_bytes{model_name=\"m\"} 300"
        );
        assert_eq!(
            line(
                &text,
                "sluice:responses_evicted_total{model_name=\"m\",reason=\"size\"}"
            ),
            "sluice:responses_evicted_total{model_name=\"m\",reason=\"size\"} 2"
        );
        assert_eq!(
            line(
                &text,
                "sluice:responses_evicted_total{model_name=\"m\",reason=\"age\"}"
            ),
            "sluice:responses_evicted_total{model_name=\"m\",reason=\"age\"} 1"
        );
        assert!(text.contains("# TYPE sluice:responses_evicted_total counter\n"));
    }

    #[test]
    fn the_cpu_kernels_tier_is_a_label_of_an_info_gauge() {
        let text = Metrics::new("m", MetricsPrefix::Vllm)
            .with_cpu_kernels("avx2".into())
            .render(&EngineStats::default(), 0);
        assert!(text.contains("# TYPE vllm:cpu_kernels_info gauge\n"));
        assert_eq!(
            line(&text, "vllm:cpu_kernels_info{"),
            "vllm:cpu_kernels_info{model_name=\"m\",tier=\"avx2\"} 1"
        );
        let without = Metrics::new("m", MetricsPrefix::Sluice).render(&EngineStats::default(), 0);
        assert!(!without.contains("cpu_kernels_info"));
    }

    #[test]
    fn engine_stats_render_as_reported() {
        let metrics = Metrics::new("smol", MetricsPrefix::Sluice);
        let stats = EngineStats {
            num_running: 3,
            num_waiting: 2,
            kv_cache_usage: 0.25,
            num_eager_fallbacks: 12,
            spec_decode_num_drafts: 7,
            spec_decode_num_draft_tokens: 28,
            spec_decode_num_accepted_tokens: 19,
            ..Default::default()
        };
        let text = metrics.render(&stats, 0);
        for (name, value) in [
            ("spec_decode_num_drafts_total", 7),
            ("spec_decode_num_draft_tokens_total", 28),
            ("spec_decode_num_accepted_tokens_total", 19),
        ] {
            assert!(
                text.contains(&format!("# TYPE sluice:{name} counter\n")),
                "{name}"
            );
            assert_eq!(
                line(&text, &format!("sluice:{name}{{")),
                format!("sluice:{name}{{model_name=\"smol\"}} {value}")
            );
        }
        assert_eq!(
            line(&text, "sluice:num_requests_running{"),
            "sluice:num_requests_running{model_name=\"smol\"} 3"
        );
        assert_eq!(
            line(&text, "sluice:kv_cache_usage_perc{"),
            "sluice:kv_cache_usage_perc{model_name=\"smol\"} 0.25"
        );
        assert!(text.contains("# TYPE sluice:num_requests_waiting gauge"));
        assert!(text.contains("# TYPE sluice:graph_eager_fallbacks_total counter\n"));
        assert_eq!(
            line(&text, "sluice:graph_eager_fallbacks_total{"),
            "sluice:graph_eager_fallbacks_total{model_name=\"smol\"} 12"
        );
    }

    #[test]
    fn iteration_tokens_render_cumulatively_from_the_engine_buckets() {
        let mut counts = vec![0; ITERATION_TOKENS_BOUNDS.len() + 1];
        // Two steps of 1 token, three of 9..=16, one above 16384.
        counts[0] = 2;
        counts[2] = 3;
        counts[ITERATION_TOKENS_BOUNDS.len()] = 1;
        let stats = EngineStats {
            iteration_tokens: counts,
            iteration_tokens_sum: 20_050,
            ..Default::default()
        };
        let text = metrics().render(&stats, 0);
        let bucket = |le: &str| {
            value(
                &text,
                &format!("sluice:iteration_tokens_total_bucket{{model_name=\"m\",le=\"{le}\"}} "),
            )
        };
        assert_eq!(bucket("1"), 2.0);
        assert_eq!(bucket("8"), 2.0);
        assert_eq!(bucket("16"), 5.0);
        assert_eq!(bucket("16384"), 5.0);
        assert_eq!(bucket("+Inf"), 6.0);
        assert_eq!(
            value(
                &text,
                "sluice:iteration_tokens_total_count{model_name=\"m\"} "
            ),
            6.0
        );
        assert_eq!(
            value(
                &text,
                "sluice:iteration_tokens_total_sum{model_name=\"m\"} "
            ),
            20050.0
        );
    }

    #[test]
    fn tokens_count_as_they_arrive_and_the_prompt_once_per_prompt() {
        let metrics = metrics();
        let prompt = metrics.prompt(10, 3);
        let arrival = Instant::now();
        let mut choices: Vec<RequestMetrics> = (0..3)
            .map(|_| RequestMetrics::new(metrics.clone(), prompt.clone(), arrival, 100.0))
            .collect();
        let read = |name: &str| {
            value(
                &metrics.render(&EngineStats::default(), 0),
                &format!("sluice:{name}{{model_name=\"m\"}} "),
            )
        };
        choices[0].on_output(1, Some(100.0));
        assert_eq!(read("generation_tokens_total"), 1.0);
        assert_eq!(read("prompt_tokens_total"), 10.0);
        for choice in &mut choices {
            choice.on_output(2, Some(100.0));
        }
        assert_eq!(read("generation_tokens_total"), 7.0);
        assert_eq!(read("prompt_tokens_total"), 10.0);
        choices[0].on_finish(FinishReason::Length);
        choices[1].on_finish(FinishReason::Stop);
        assert_eq!(read("request_max_num_generation_tokens_count"), 0.0);
        choices[2].on_finish(FinishReason::Stop);
        choices[2].on_finish(FinishReason::Abort);
        assert_eq!(read("request_max_num_generation_tokens_count"), 1.0);
        assert_eq!(read("request_max_num_generation_tokens_sum"), 3.0);
        assert_eq!(read("request_generation_tokens_count"), 3.0);
        assert_eq!(read("request_prompt_tokens_count"), 1.0);
        let text = metrics.render(&EngineStats::default(), 0);
        assert!(text.contains(
            "sluice:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 2\n"
        ));
        assert!(text.contains(
            "sluice:request_success_total{model_name=\"m\",finished_reason=\"abort\"} 0\n"
        ));
    }

    #[test]
    fn an_embedding_counts_its_prompt_and_no_token() {
        let metrics = metrics();
        let mut request =
            RequestMetrics::new(metrics.clone(), metrics.prompt(7, 1), Instant::now(), 0.0);
        request.on_output(0, Some(0.0));
        request.on_embedding();
        request.on_finish(FinishReason::Stop);
        let text = metrics.render(&EngineStats::default(), 0);
        let read = |name: &str| value(&text, &format!("sluice:{name}{{model_name=\"m\"}} "));
        assert_eq!(read("prompt_tokens_total"), 7.0);
        assert_eq!(read("request_prompt_tokens_count"), 1.0);
        assert_eq!(read("generation_tokens_total"), 0.0);
        assert_eq!(read("time_to_first_token_seconds_count"), 0.0);
    }

    #[test]
    fn queue_and_prefill_split_the_time_to_first_token() {
        let metrics = metrics();
        let arrival = Instant::now() - std::time::Duration::from_millis(500);
        let mut request =
            RequestMetrics::new(metrics.clone(), metrics.prompt(4, 1), arrival, 1000.0);
        // Scheduled 0.2 s after arrival; the first token arrives now, 0.5 s after it.
        request.on_output(0, Some(1000.2));
        request.on_output(1, Some(1000.2));
        request.on_finish(FinishReason::Stop);
        let text = metrics.render(&EngineStats::default(), 0);
        let read = |name: &str| value(&text, &format!("sluice:{name}{{model_name=\"m\"}} "));
        assert_eq!(read("request_queue_time_seconds_count"), 1.0);
        assert!((read("request_queue_time_seconds_sum") - 0.2).abs() < 1e-9);
        let ttft = read("time_to_first_token_seconds_sum");
        assert!(ttft >= 0.5);
        assert!((read("request_prefill_time_seconds_sum") - (ttft - 0.2)).abs() < 1e-9);
        assert_eq!(read("request_decode_time_seconds_count"), 1.0);
    }

    #[test]
    fn queue_time_is_clamped_to_what_the_frontend_saw_pass() {
        let metrics = metrics();
        let mut request =
            RequestMetrics::new(metrics.clone(), metrics.prompt(4, 1), Instant::now(), 50.0);
        // An engine clock a minute ahead cannot make the queue longer than the request's life.
        request.on_output(1, Some(110.0));
        let text = metrics.render(&EngineStats::default(), 0);
        let queue = value(
            &text,
            "sluice:request_queue_time_seconds_sum{model_name=\"m\"} ",
        );
        assert!((0.0..1.0).contains(&queue), "{queue}");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let metrics = Metrics::new("m", MetricsPrefix::Sluice);
        for value in [0.003, 0.05, 0.05, 100.0] {
            metrics.time_to_first_token.observe(value);
        }
        let text = metrics.render(&EngineStats::default(), 0);
        let bucket = |le: &str| {
            let prefix = format!(
                "sluice:time_to_first_token_seconds_bucket{{model_name=\"m\",le=\"{le}\"}} "
            );
            line(&text, &prefix)[prefix.len()..].parse::<u64>().unwrap()
        };
        assert_eq!(bucket("0.001"), 0);
        assert_eq!(bucket("0.005"), 1);
        assert_eq!(bucket("0.06"), 3);
        assert_eq!(bucket("80"), 3);
        assert_eq!(bucket("+Inf"), 4);
        assert!(text.contains("sluice:time_to_first_token_seconds_count{model_name=\"m\"} 4\n"));
    }

    #[test]
    fn the_vllm_prefix_renames_every_metric() {
        let sluice = Metrics::new("m", MetricsPrefix::Sluice).render(&EngineStats::default(), 0);
        let vllm = Metrics::new("m", MetricsPrefix::Vllm).render(&EngineStats::default(), 0);
        assert!(!vllm.contains("sluice:"));
        assert_eq!(sluice.replace("sluice:", "vllm:"), vllm);
    }

    #[test]
    fn label_values_are_escaped() {
        let text = Metrics::new("a\"b", MetricsPrefix::Sluice).render(&EngineStats::default(), 0);
        assert!(text.contains("model_name=\"a\\\"b\""));
    }
}
