"""Stress drivers against a running `sluice serve`: a burst of clients larger than its waiting queue
(load_storm), clients that leave at random points (disconnect_storm) and a soak of mixed traffic (soak).

Each run ends with the server's books: its engine gauges and block-pool audit (server_state) and the
resident memory of each of its processes (process_rss). bench/ runs them full-size from the command
line; tests/e2e/ runs short versions against a server of its own.
"""
