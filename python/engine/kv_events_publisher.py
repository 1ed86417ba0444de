"""Publishes the prefix cache's changes to routers: one numbered `kv_events` message per engine step.

The block pool appends events to `pending` as they happen; the engine core calls `publish` once per
step (and before it answers a `kv_cache` snapshot call, so that the snapshot's seq covers every
change the snapshot shows). A PUB socket never blocks the engine: a subscriber that is too slow
loses messages, sees the gap in `seq`, and reads a snapshot again.
"""

from __future__ import annotations

import zmq

from sluice.errors import InvalidConfigError
from sluice.kv_events_seam import KVEvent, KVEvents, encode

# How long closing the socket may wait for the last messages to leave.
_LINGER_MS = 500


class KVEventPublisher:
    def __init__(self, host: str, port: int) -> None:
        self.port = port
        self.pending: list[KVEvent] = []
        # The seq of the last message sent; 0 before the first.
        self.seq = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.linger = _LINGER_MS
        # ZeroMQ takes an IPv6 address in brackets, and only on a socket with IPv6 turned on.
        ipv6 = ":" in host
        self._socket.ipv6 = ipv6
        endpoint = f"tcp://[{host}]:{port}" if ipv6 else f"tcp://{host}:{port}"
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise InvalidConfigError(
                f"--kv-events-host {host} --kv-events-port {port}: cannot bind {endpoint}: {exc}"
            ) from None

    def publish(self) -> None:
        """Send the pending events as one message, if there are any."""
        if not self.pending:
            return
        self.seq += 1
        message = KVEvents(seq=self.seq, events=list(self.pending))
        # Cleared in place: the block pool appends to this very list.
        self.pending.clear()
        # PUB drops rather than blocks when a subscriber's queue is full; the seq gap reports it.
        self._socket.send(encode(message))

    def close(self) -> None:
        self._socket.close()
        self._context.term()
