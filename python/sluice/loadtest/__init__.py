"""`sluice bench serve` and `sluice bench sweep`: a load-test harness for any OpenAI-compatible server."""
