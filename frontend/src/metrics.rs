//! Prometheus metrics, named as vLLM names them with the prefix `sluice:`.
//!
//! Counters and histograms are atomics updated by request handlers; the engine's own gauges
//! (running, waiting, KV usage, prefix cache, preemptions, eager fallbacks) arrive with its output batches and are
//! rendered as they were last reported.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

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

/// Finish reasons a request can end with; each has its own success counter series.
pub const FINISH_REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

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
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        let (sum, count) = *self.sum_and_count.lock().expect("histogram lock poisoned");
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// The engine's gauges and running totals, as its last output batch reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineGauges {
    pub num_running: u64,
    pub num_waiting: u64,
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub num_eager_fallbacks: u64,
    /// Engine cores that took over after one was lost, as the frontend's engine client counts them.
    pub engine_restarts: u64,
}

pub struct Metrics {
    model_name: String,
    request_success: [AtomicU64; FINISH_REASONS.len()],
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
}

impl Metrics {
    pub fn new(model_name: impl Into<String>) -> Self {
        Metrics {
            model_name: model_name.into(),
            request_success: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_BUCKETS),
            request_queue_time: Histogram::new(REQUEST_BUCKETS),
        }
    }

    /// Counts one finished request; an unknown reason is a bug upstream, so it is counted as an error.
    pub fn record_finished(&self, finish_reason: &str, prompt_tokens: u64, generation_tokens: u64) {
        let index = FINISH_REASONS
            .iter()
            .position(|&r| r == finish_reason)
            .unwrap_or(FINISH_REASONS.len() - 1);
        self.request_success[index].fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generation_tokens, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self, engine: &EngineGauges) -> String {
        let labels = format!("model_name=\"{}\"", escape_label(&self.model_name));
        let mut out = String::with_capacity(8192);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}"
            );
        };
        metric(
            "sluice:num_requests_running",
            "gauge",
            "Requests in the running batch.",
            engine.num_running.to_string(),
        );
        metric(
            "sluice:num_requests_waiting",
            "gauge",
            "Requests waiting to be scheduled.",
            engine.num_waiting.to_string(),
        );
        metric(
            "sluice:kv_cache_usage_perc",
            "gauge",
            "Fraction of KV cache blocks in use (1 = full).",
            engine.kv_cache_usage.to_string(),
        );
        metric(
            "sluice:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            engine.prefix_cache_queries.to_string(),
        );
        metric(
            "sluice:prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            engine.prefix_cache_hits.to_string(),
        );
        metric(
            "sluice:num_preemptions_total",
            "counter",
            "Requests preempted by the scheduler.",
            engine.num_preemptions.to_string(),
        );
        metric(
            "sluice:graph_eager_fallbacks_total",
            "counter",
            "Engine steps that graphs were on for but that ran eagerly because no captured graph shape fit them.",
            engine.num_eager_fallbacks.to_string(),
        );
        metric(
            "sluice:engine_restarts_total",
            "counter",
            "Times a restarted engine core took over after the engine core was lost.",
            engine.engine_restarts.to_string(),
        );
        metric(
            "sluice:prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sluice:generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            self.generation_tokens.load(Ordering::Relaxed).to_string(),
        );
        let name = "sluice:request_success_total";
        let _ = writeln!(
            out,
            "# HELP {name} Finished requests by finish reason.\n# TYPE {name} counter"
        );
        for (reason, count) in FINISH_REASONS.iter().zip(&self.request_success) {
            let _ = writeln!(
                out,
                "{name}{{{labels},finished_reason=\"{reason}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        self.time_to_first_token.render(
            &mut out,
            "sluice:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            &labels,
        );
        self.inter_token_latency.render(
            &mut out,
            "sluice:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            &labels,
        );
        self.e2e_request_latency.render(
            &mut out,
            "sluice:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            &labels,
        );
        self.request_queue_time.render(
            &mut out,
            "sluice:request_queue_time_seconds",
            "Time from arrival until the request was handed to the engine.",
            &labels,
        );
        out
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

    #[test]
    fn gauges_render_as_reported() {
        let metrics = Metrics::new("smol");
        let gauges = EngineGauges {
            num_running: 3,
            num_waiting: 2,
            kv_cache_usage: 0.25,
            ..Default::default()
        };
        let text = metrics.render(&gauges);
        assert_eq!(
            line(&text, "sluice:num_requests_running{"),
            "sluice:num_requests_running{model_name=\"smol\"} 3"
        );
        assert_eq!(
            line(&text, "sluice:kv_cache_usage_perc{"),
            "sluice:kv_cache_usage_perc{model_name=\"smol\"} 0.25"
        );
        assert!(text.contains("# TYPE sluice:num_requests_waiting gauge"));
    }

    #[test]
    fn eager_fallbacks_render_as_a_counter() {
        let gauges = EngineGauges {
            num_eager_fallbacks: 12,
            ..Default::default()
        };
        let text = Metrics::new("smol").render(&gauges);
        assert!(text.contains("# TYPE sluice:graph_eager_fallbacks_total counter\n"));
        assert_eq!(
            line(&text, "sluice:graph_eager_fallbacks_total{"),
            "sluice:graph_eager_fallbacks_total{model_name=\"smol\"} 12"
        );
    }

    #[test]
    fn finished_requests_count_by_reason_and_tokens() {
        let metrics = Metrics::new("m");
        metrics.record_finished("stop", 10, 4);
        metrics.record_finished("length", 5, 16);
        metrics.record_finished("length", 1, 1);
        let text = metrics.render(&EngineGauges::default());
        assert!(text.contains(
            "sluice:request_success_total{model_name=\"m\",finished_reason=\"length\"} 2\n"
        ));
        assert!(text.contains(
            "sluice:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 1\n"
        ));
        assert!(text.contains("sluice:prompt_tokens_total{model_name=\"m\"} 16\n"));
        assert!(text.contains("sluice:generation_tokens_total{model_name=\"m\"} 21\n"));
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let metrics = Metrics::new("m");
        for value in [0.003, 0.05, 0.05, 100.0] {
            metrics.time_to_first_token.observe(value);
        }
        let text = metrics.render(&EngineGauges::default());
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
    fn label_values_are_escaped() {
        let text = Metrics::new("a\"b").render(&EngineGauges::default());
        assert!(text.contains("model_name=\"a\\\"b\""));
    }
}
