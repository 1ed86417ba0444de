//! The router's Prometheus metrics (`sluice_router:` prefix), labelled by replica.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::policies::{ReplicaId, RouteReason};
use crate::replicas::Replica;

/// Upper bounds of the prefix-match histogram's buckets, in tokens.
const PREFIX_BUCKETS: [usize; 8] = [0, 16, 64, 128, 256, 512, 1024, 4096];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Counter {
    Requests,
    Errors,
    Ejections,
    Retries,
}

impl Counter {
    const ALL: [Counter; 4] = [
        Counter::Requests,
        Counter::Errors,
        Counter::Ejections,
        Counter::Retries,
    ];

    fn name(self) -> &'static str {
        match self {
            Counter::Requests => "requests_total",
            Counter::Errors => "errors_total",
            Counter::Ejections => "ejections_total",
            Counter::Retries => "retries_total",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Counter::Requests => {
                "Attempts sent to the replica (a retried request counts once per attempt)."
            }
            Counter::Errors => "Failed attempts and streams broken mid-way.",
            Counter::Ejections => {
                "Times the replica was taken out of routing (health checks or its circuit breaker)."
            }
            Counter::Retries => {
                "Requests retried elsewhere after the replica failed them before the first byte."
            }
        }
    }
}

#[derive(Default)]
struct Histogram {
    buckets: [u64; PREFIX_BUCKETS.len()],
    sum: u64,
    count: u64,
}

#[derive(Default)]
struct Values {
    counters: BTreeMap<(Counter, ReplicaId), u64>,
    decisions: BTreeMap<(ReplicaId, &'static str), u64>,
    prefix_match: BTreeMap<ReplicaId, Histogram>,
}

#[derive(Default)]
pub struct Metrics {
    values: Mutex<Values>,
}

impl Metrics {
    fn add(&self, counter: Counter, replica: &ReplicaId) {
        let mut values = self.values.lock().expect("metrics lock");
        *values
            .counters
            .entry((counter, replica.clone()))
            .or_default() += 1;
    }

    pub fn request(&self, replica: &ReplicaId) {
        self.add(Counter::Requests, replica);
    }

    pub fn error(&self, replica: &ReplicaId) {
        self.add(Counter::Errors, replica);
    }

    pub fn ejection(&self, replica: &ReplicaId) {
        self.add(Counter::Ejections, replica);
    }

    pub fn retry(&self, failed_replica: &ReplicaId) {
        self.add(Counter::Retries, failed_replica);
    }

    pub fn decision(&self, replica: &ReplicaId, reason: RouteReason, prefix_tokens: Option<usize>) {
        let mut values = self.values.lock().expect("metrics lock");
        *values
            .decisions
            .entry((replica.clone(), reason.as_str()))
            .or_default() += 1;
        if let Some(tokens) = prefix_tokens {
            let histogram = values.prefix_match.entry(replica.clone()).or_default();
            for (bucket, &bound) in histogram.buckets.iter_mut().zip(&PREFIX_BUCKETS) {
                if tokens <= bound {
                    *bucket += 1;
                }
            }
            histogram.sum += tokens as u64;
            histogram.count += 1;
        }
    }

    /// The Prometheus text exposition; in-flight counts are read from the replicas themselves.
    pub fn render(&self, replicas: &[std::sync::Arc<Replica>]) -> String {
        let values = self.values.lock().expect("metrics lock");
        let mut out = String::new();
        for counter in Counter::ALL {
            let name = counter.name();
            let _ = writeln!(out, "# HELP sluice_router:{name} {}", counter.help());
            let _ = writeln!(out, "# TYPE sluice_router:{name} counter");
            for ((_, replica), value) in values.counters.iter().filter(|((c, _), _)| *c == counter)
            {
                let _ = writeln!(out, "sluice_router:{name}{{replica=\"{replica}\"}} {value}");
            }
        }
        out.push_str("# HELP sluice_router:requests_in_flight Requests sent to the replica that have not finished.\n");
        out.push_str("# TYPE sluice_router:requests_in_flight gauge\n");
        for replica in replicas {
            let _ = writeln!(
                out,
                "sluice_router:requests_in_flight{{replica=\"{}\"}} {}",
                replica.id,
                replica.outstanding()
            );
        }
        out.push_str("# HELP sluice_router:routing_decisions_total Replicas picked by the policy, by reason.\n");
        out.push_str("# TYPE sluice_router:routing_decisions_total counter\n");
        for ((replica, reason), value) in &values.decisions {
            let _ = writeln!(
                out,
                "sluice_router:routing_decisions_total{{replica=\"{replica}\",reason=\"{reason}\"}} {value}"
            );
        }
        out.push_str("# HELP sluice_router:prefix_match_tokens Prompt tokens the picked replica was believed to hold (cache-aware).\n");
        out.push_str("# TYPE sluice_router:prefix_match_tokens histogram\n");
        for (replica, histogram) in &values.prefix_match {
            for (bound, count) in PREFIX_BUCKETS.iter().zip(histogram.buckets) {
                let _ = writeln!(
                    out,
                    "sluice_router:prefix_match_tokens_bucket{{replica=\"{replica}\",le=\"{bound}\"}} {count}"
                );
            }
            let _ = writeln!(
                out,
                "sluice_router:prefix_match_tokens_bucket{{replica=\"{replica}\",le=\"+Inf\"}} {}",
                histogram.count
            );
            let _ = writeln!(
                out,
                "sluice_router:prefix_match_tokens_sum{{replica=\"{replica}\"}} {}",
                histogram.sum
            );
            let _ = writeln!(
                out,
                "sluice_router:prefix_match_tokens_count{{replica=\"{replica}\"}} {}",
                histogram.count
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_the_histogram_render_per_replica() {
        let metrics = Metrics::default();
        let a = ReplicaId("http://a:1".into());
        metrics.request(&a);
        metrics.request(&a);
        metrics.retry(&a);
        metrics.decision(&a, RouteReason::PrefixMatch, Some(100));
        metrics.decision(&a, RouteReason::RoundRobin, None);
        let text = metrics.render(&[]);
        assert!(text.contains("sluice_router:requests_total{replica=\"http://a:1\"} 2\n"));
        assert!(text.contains("sluice_router:retries_total{replica=\"http://a:1\"} 1\n"));
        assert!(text.contains(
            "sluice_router:routing_decisions_total{replica=\"http://a:1\",reason=\"prefix_match\"} 1\n"
        ));
        assert!(text.contains("prefix_match_tokens_bucket{replica=\"http://a:1\",le=\"64\"} 0\n"));
        assert!(text.contains("prefix_match_tokens_bucket{replica=\"http://a:1\",le=\"128\"} 1\n"));
        assert!(text.contains("prefix_match_tokens_sum{replica=\"http://a:1\"} 100\n"));
        assert!(text.contains("prefix_match_tokens_count{replica=\"http://a:1\"} 1\n"));
    }
}
