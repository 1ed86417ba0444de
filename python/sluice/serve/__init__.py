"""`sluice serve`: one replica (the engine core process and the Rust frontend binary), or with
--data-parallel-size N, N replicas on internal loopback ports behind the `sluice-router` binary; supervised.

Every child gets its own process group, so that a terminal's Ctrl-C reaches only this process,
which then stops them in order: the router first, then the frontends (they stop taking requests
and drain the ones in flight), then the engine cores. Each child also gets SIGTERM from the kernel
if this process dies without cleaning up. A replica's frontend and engine core talk over IPC
sockets in a private (0700) temporary folder. Each of N > 1 replicas runs on its share of the
cores (its processes' affinity), so its workers size and pin their threads within that share.

An engine core that dies (or whose worker dies) is restarted, after a backoff, on the same IPC
sockets; its frontend stays up, fails what was in flight, answers 503 meanwhile and reconnects
(`docs/protocol.md`, Restarts). More than --max-engine-restarts restarts within
--engine-restart-window-s seconds end the server; --no-restart-engine ends it at the first death.

Exit status: 0 after SIGINT or SIGTERM; 3 when an engine core died and was not restarted (after
giving its frontend a few seconds to fail what was in flight); a frontend's or the router's own
status (or 1) when it exited by itself; 1 when the server never became ready. Whatever else is
running is then stopped.

The package: `flags` (serve's own options), `argv` (each child's command line and environment), `child`
(one supervised process), `restart_budget`, `replica` (a frontend and its engine core), `supervisor`
(signals and waiting) and `run` (start, supervise, stop).
"""
