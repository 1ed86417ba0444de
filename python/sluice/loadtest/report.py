"""The human-readable summary printed after a run."""

from __future__ import annotations

from typing import Any

from sluice.loadtest.metrics import LATENCY_METRICS, STATISTICS

NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def render_report(result: dict[str, Any]) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any, fmt: str = "{:<40} {:<10.2f}") -> None:
        lines.append(fmt.format(label + ":", value))

    row("Successful requests", result["completed"], "{:<40} {:<10}")
    row("Failed requests", result["failed"], "{:<40} {:<10}")
    for reason, count in sorted(result["failures_by_reason"].items()):
        row(f"  {reason}", count, "{:<40} {:<10}")
    row("Benchmark duration (s)", result["duration"])
    row("Total input tokens", result["total_input_tokens"], "{:<40} {:<10}")
    row("Total generated tokens", result["total_output_tokens"], "{:<40} {:<10}")
    row("Request throughput (req/s)", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s)", result["request_goodput"])
    row("Output token throughput (tok/s)", result["output_throughput"])
    row("Total token throughput (tok/s)", result["total_token_throughput"])
    row("Peak concurrent requests", result["max_concurrency_reached"], "{:<40} {:<10}")
    if result["requests_without_usage"]:
        row("Requests without usage (counted chunks)", result["requests_without_usage"], "{:<40} {:<10}")
    row("Harness CPU (s)", result["harness_cpu_seconds"])
    row("Harness CPU (% of one core)", result["harness_cpu_percent"])
    for metric in LATENCY_METRICS:
        lines.append("{:-^60}".format(f" {NAMES[metric]} "))
        for stat in STATISTICS:
            row(f"{stat.capitalize()} {metric.upper()} (ms)", result[f"{stat}_{metric}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
