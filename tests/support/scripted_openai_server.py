"""A small scripted OpenAI-compatible server for testing load-test clients (`sluice bench serve`).

Every response is fully determined by a `Script`: when each token is sent, how many there are, which requests
fail and how. That lets a test compare what a client measures against what the server was told to do.

    with ScriptedServer(Script(ttft=0.05, itl=0.01)) as server:
        ...  # point the client at server.url, then inspect server.arrivals / server.max_in_flight

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed or not), GET /v1/models, GET /health,
POST /tokenize, POST /detokenize. The tokenizer is character level: token id = ord(char). Generated token i
is chr(ord("a") + i % 26).

Only the standard library is used, so the suite needs no extra packages: a `ThreadingHTTPServer` (one daemon
thread per connection) runs in a background thread.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

MODEL_NAME = "scripted"
MAX_MODEL_LEN = 4096
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
GENERATION_PATHS = (COMPLETIONS_PATH, CHAT_PATH)
# Not valid JSON, so a client's parser must fail on it; it still looks like an ordinary SSE data line.
MALFORMED_DATA_LINE = b'data: {"choices": [{"text": "oops"\n\n'


@dataclass
class Script:
    ttft: float = 0.05  # seconds from receiving the request to the first streamed token
    itl: float = 0.01  # seconds between consecutive streamed tokens
    output_tokens: int = 8  # tokens generated when the request has no max_tokens / max_completion_tokens
    fail_every: int = 0  # every k-th request (1-based, k > 0) answers HTTP 500 with an OpenAI error body
    malformed_every: int = 0  # every k-th request streams one malformed SSE data line after the first token
    report_usage: bool = True  # include usage (non-stream always when True; stream only if include_usage)


class _BadRequest(Exception):
    """A request the server answers with HTTP 400 and an OpenAI error body."""


def generated_text(count: int) -> str:
    """The text of `count` generated tokens: "abc…z" repeating, one character per token."""
    return "".join(chr(ord("a") + i % 26) for i in range(count))


def _error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    # OpenAI's error shape; clients read error.message for the failure reason.
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def _prompt_length(prompt: Any) -> int:
    """Prompt tokens of a completions prompt: a string (one token per char) or a list of token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        # A batch of one prompt is the same request; larger batches would need several choices.
        if len(prompt) == 1:
            return _prompt_length(prompt[0])
        raise _BadRequest("batched prompts are not supported by the scripted server")
    raise _BadRequest("prompt must be a string or a list of token ids")


def _chat_prompt_length(messages: Any) -> int:
    """Prompt tokens of a chat request: the summed length of the messages' contents (text parts only)."""
    if not isinstance(messages, list):
        raise _BadRequest("messages must be a list")
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total


class _HTTPServer(ThreadingHTTPServer):
    # Daemon handler threads so a stuck client can never keep the test process alive.
    daemon_threads = True
    # The default backlog of 5 drops SYNs when a client opens many connections at once (request rate inf),
    # and the kernel's 1 s SYN retry would then show up as bogus TTFT.
    request_queue_size = 1024

    def __init__(self, owner: ScriptedServer) -> None:
        self.owner = owner
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 so clients may keep connections alive; streams use chunked transfer encoding.
    protocol_version = "HTTP/1.1"
    # Each SSE chunk is a small write; with Nagle's algorithm on, a chunk could wait ~40 ms for the ACK of
    # the previous one (delayed ACK) and the measured inter-token latency would be wrong.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.owner._register_connection(self.connection)

    def finish(self) -> None:
        self.server.owner._unregister_connection(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        # Keep test output quiet; the bookkeeping on ScriptedServer is what tests look at.
        pass

    # ---- plumbing -------------------------------------------------------------------------------------

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            return json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(f"request body is not valid JSON: {exc}") from exc

    def _send_bytes(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        # Content-Length lets keep-alive clients know where the body ends.
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, body: Any) -> None:
        self._send_bytes(status, json.dumps(body).encode())

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()  # flushes the headers now, so the client sees the response start at once

    def _write_chunk(self, payload: bytes, last: bool = False) -> None:
        # One write per HTTP chunk (header, data and, for the last, the terminator) so it leaves in one send.
        data = b"%x\r\n%s\r\n" % (len(payload), payload)
        if last:
            data += b"0\r\n\r\n"
        self.wfile.write(data)

    @staticmethod
    def _event(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    # ---- routing --------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "sluice-tests"}
            model["max_model_len"] = MAX_MODEL_LEN
            self._send_json(200, {"object": "list", "data": [model]})
        elif self.path == "/health":
            # What routers poll before they send a replica anything.
            self._send_bytes(200, b"")
        else:
            self._send_json(404, _error_body(f"no route for GET {self.path}", "NotFoundError", 404))

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if path in GENERATION_PATHS:
            self._generate(chat=path == CHAT_PATH)
            return
        try:
            if path == "/tokenize":
                self._tokenize()
            elif path == "/detokenize":
                self._detokenize()
            else:
                self._read_json()  # drain the body so a keep-alive connection stays in sync
                self._send_json(404, _error_body(f"no route for POST {self.path}", "NotFoundError", 404))
        except _BadRequest as exc:
            self._send_json(400, _error_body(str(exc), "BadRequestError", 400))

    def _tokenize(self) -> None:
        body = self._read_json()
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise _BadRequest("prompt must be a string")
        tokens = [ord(c) for c in prompt]
        self._send_json(200, {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN})

    def _detokenize(self) -> None:
        body = self._read_json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _BadRequest("tokens must be a list of integers")
        try:
            prompt = "".join(chr(t) for t in tokens)
        except (ValueError, OverflowError) as exc:
            raise _BadRequest(f"token id out of range: {exc}") from exc
        self._send_json(200, {"prompt": prompt})

    # ---- generation -----------------------------------------------------------------------------------

    def _generate(self, chat: bool) -> None:
        owner = self.server.owner
        # The clock starts before the body is read: "from receiving the request".
        index, start = owner._arrive()
        done = False

        def finish() -> None:
            # Called just before the response's final bytes are written: once a client has seen the end of
            # a response it may send its next request, and that one must not overlap this one in the count.
            nonlocal done
            if not done:
                done = True
                owner._depart()

        try:
            self._generate_response(chat, start, index, finish)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            # The client went away mid-response: nothing to answer; the connection is dropped below.
            self.close_connection = True
        finally:
            finish()

    def _generate_response(self, chat: bool, start: float, index: int, finish: Callable[[], None]) -> None:
        owner = self.server.owner
        script = owner.script
        try:
            body = self._read_json()
            if not isinstance(body, dict):
                raise _BadRequest("request body must be a JSON object")
            prompt_tokens = (
                _chat_prompt_length(body.get("messages")) if chat else _prompt_length(body.get("prompt"))
            )
            count = body.get("max_tokens")
            if count is None:
                count = body.get("max_completion_tokens")
            if count is None:
                count = script.output_tokens
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise _BadRequest("max_tokens must be a non-negative integer")
        except _BadRequest as exc:
            finish()
            self._send_json(400, _error_body(str(exc), "BadRequestError", 400))
            return

        if script.fail_every > 0 and index % script.fail_every == 0:
            # Answered at once: the failure is about the status and body, not timing.
            finish()
            message = f"scripted failure of request {index}"
            self._send_json(500, _error_body(message, "InternalServerError", 500))
            return

        malformed = script.malformed_every > 0 and index % script.malformed_every == 0
        stream = bool(body.get("stream"))
        stream_options = body.get("stream_options") or {}
        include_usage = isinstance(stream_options, dict) and bool(stream_options.get("include_usage"))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
        }
        common = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{index}",
            "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
        }
        if stream:
            self._stream(chat, start, count, malformed, usage if include_usage else None, common, finish)
        else:
            self._respond_whole(chat, start, count, malformed, usage, common, finish)

    def _sleep_until(self, deadline: float) -> None:
        """Sleep until `deadline` (time.monotonic()); raise if the server is closing, to abandon the reply."""
        owner = self.server.owner
        delay = deadline - time.monotonic()
        if delay > 0 and owner._stopping.wait(delay):
            raise ConnectionAbortedError("scripted server closing")
        if owner._stopping.is_set():
            raise ConnectionAbortedError("scripted server closing")

    def _respond_whole(
        self,
        chat: bool,
        start: float,
        count: int,
        malformed: bool,
        usage: dict[str, int],
        common: dict[str, Any],
        finish: Callable[[], None],
    ) -> None:
        script = self.server.owner.script
        # A non-streamed answer arrives when the last token would have been streamed.
        self._sleep_until(start + script.ttft + max(count - 1, 0) * script.itl)
        finish()
        if malformed:
            self._send_bytes(200, b'{"choices": [{"text": "oops"')
            return
        text = generated_text(count)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            response: dict[str, Any] = {**common, "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            response = {**common, "object": "text_completion"}
        choice["finish_reason"] = "length"
        response["choices"] = [choice]
        if script.report_usage:
            response["usage"] = usage
        self._send_json(200, response)

    def _stream(
        self,
        chat: bool,
        start: float,
        count: int,
        malformed: bool,
        usage: dict[str, int] | None,
        common: dict[str, Any],
        finish: Callable[[], None],
    ) -> None:
        script = self.server.owner.script
        report_usage = usage is not None and script.report_usage
        base: dict[str, Any] = {**common, "object": "chat.completion.chunk" if chat else "text_completion"}
        if usage is not None:
            # As OpenAI does when include_usage is set: every chunk but the usage chunk has "usage": null.
            base["usage"] = None
        self._start_stream()

        for i in range(count):
            self._sleep_until(start + script.ttft + i * script.itl)
            last = i == count - 1
            piece = chr(ord("a") + i % 26)
            finish_reason = "length" if last else None
            payload = b""
            if chat:
                if i == 0:
                    # The role delta comes with the first token, not before it, so it cannot be mistaken
                    # for an early first token; its empty content is what real servers send.
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    payload += self._event({**base, "choices": [role]})
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason}
            payload += self._event({**base, "choices": [choice]})
            if malformed:
                self._write_chunk(payload)
                break
            if last and not report_usage:
                finish()
                self._write_chunk(payload + b"data: [DONE]\n\n", last=True)
                return
            self._write_chunk(payload)

        if malformed:
            # The bad line takes the next token's slot; then the stream ends without [DONE].
            self._sleep_until(start + script.ttft + (1 if count > 0 else 0) * script.itl)
            finish()
            self._write_chunk(MALFORMED_DATA_LINE, last=True)
            return

        tail = b""
        if report_usage:
            tail += self._event({**base, "choices": [], "usage": usage})
        if count == 0:
            self._sleep_until(start + script.ttft)
        finish()
        self._write_chunk(tail + b"data: [DONE]\n\n", last=True)


class ScriptedServer:
    """The scripted server, listening on 127.0.0.1 on a free port from construction until `close()`.

    Use it as a context manager: `with ScriptedServer(Script(...)) as server:`. `url`, `arrivals` and
    `max_in_flight` are the contract; `in_flight` (current generation requests) is there for diagnostics.
    """

    url: str
    arrivals: list[float]
    max_in_flight: int
    in_flight: int

    def __init__(self, script: Script) -> None:
        self.script = script
        self.arrivals = []
        self.max_in_flight = 0
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        # Bound here (not in __enter__) so url is valid as soon as the object exists.
        self._httpd = _HTTPServer(self)
        host, port = self._httpd.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-openai-server"
        )
        self._thread.daemon = True
        self._thread.start()
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, abandon replies in progress and drop open connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()  # wakes handlers sleeping until their next token
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            # Handler threads idle on a keep-alive connection block in recv(); shutting the socket down
            # returns them at once instead of leaving them until the client hangs up.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # ---- bookkeeping (called from handler threads) ----------------------------------------------------

    def _arrive(self) -> tuple[int, float]:
        """Record a generation request; returns its 1-based index (which decides scripted failures) and time."""
        with self._lock:
            # Read the clock under the lock so `arrivals` is in time order as well as in arrival order.
            when = time.monotonic()
            self.arrivals.append(when)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.arrivals), when

    def _depart(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _register_connection(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)

    def _unregister_connection(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)
