"""A scripted Messages API on 127.0.0.1 that timestamps every exchange (bench only).

Answers ``POST /v1/messages`` as JSON, or as server-sent events when the request
asks ``"stream": true`` (the whole event stream is built first and written in one
go, with a content-length, so "response sent" is one well-defined instant);
``POST /v1/messages/count_tokens`` with a chars/4 estimate; ``HEAD`` with 200;
any other path with a 404 error object. Every exchange is recorded with the
``time.perf_counter()`` instants its request was read and its response written,
so a caller in the same process can put them on one clock with its own.

Usage is the real API's (``orchestrator.testing.messages``, the rules tests use too): input
from the request, prompt-cache reads and writes by the documented prefix rules, a prompt
over the window refused with the real 400. Each exchange keeps the usage it reported, so a
bench can price it (``orchestrator.models.pricing.cost``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orchestrator.testing.messages import Messages, Refused, tokens

# body -> (label, reply): reply is {"content": [...], "stop_reason": ...}
Responder = Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]


@dataclass
class Exchange:
    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    t_recv: float  # perf_counter once the whole request was read
    t_sent: float = 0.0  # perf_counter once the whole response was written
    label: str = ""
    stream: bool = False
    status: int = 200
    usage: dict[str, Any] | None = None  # as reported (None: not a message, or refused)


@dataclass
class FakeServer:
    responder: Responder
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    base_url: str = ""
    port: int = 0
    rules: Messages = field(default_factory=Messages)  # the cache and windows it answers by

    def messages(self) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.path.split("?")[0] == "/v1/messages"]

    def reset(self) -> None:
        with self.lock:
            self.exchanges.clear()


def estimate_tokens(value: Any) -> int:
    """The one estimate used everywhere here (the Messages rules' ``tokens``): characters of
    the canonical JSON text / 4."""
    return tokens(value)


def sse(message: dict[str, Any]) -> bytes:
    """A whole Messages API event stream for ``message`` (a complete message object)."""
    events: list[tuple[str, dict[str, Any]]] = []
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 1}
    events.append(("message_start", {"type": "message_start", "message": start}))
    for i, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            head = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            head = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": head},
            )
        )
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events)


def _handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def _record(self, body: dict[str, Any] | None) -> Exchange:
            ex = Exchange(
                method=self.command,
                path=self.path,
                body=body,
                headers={k.lower(): v for k, v in self.headers.items()},
                t_recv=time.perf_counter(),
            )
            with server.lock:
                server.exchanges.append(ex)
            return ex

        def _write(self, ex: Exchange, code: int, ctype: str, raw: bytes) -> None:
            body = raw if self.command != "HEAD" else b""
            head = (
                f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n"
                f"content-type: {ctype}\r\ncontent-length: {len(raw)}\r\n"
                f"request-id: req_bench_{id(ex):x}\r\n\r\n"
            )
            # status, headers and body in one write: "response sent" is one instant
            self.wfile.write(head.encode() + body)
            self.wfile.flush()
            ex.status = code
            ex.t_sent = time.perf_counter()

        def _error(self, ex: Exchange, code: int, kind: str, msg: str) -> None:
            err = {"type": "error", "error": {"type": kind, "message": msg}}
            self._write(ex, code, "application/json", json.dumps(err).encode())

        def do_HEAD(self) -> None:
            self._write(self._record(None), 200, "application/json", b"")

        def do_GET(self) -> None:
            self._error(self._record(None), 404, "not_found_error", f"no {self.path} here")

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            ex = self._record(body if isinstance(body, dict) else None)
            path = self.path.split("?")[0]
            if ex.body is None:
                self._error(ex, 400, "invalid_request_error", "the body is not a JSON object")
            elif path == "/v1/messages/count_tokens":
                ex.label = "count_tokens"
                out = {"input_tokens": server.rules.count(ex.body)}
                self._write(ex, 200, "application/json", json.dumps(out).encode())
            elif path == "/v1/messages":
                self._messages(ex, ex.body)
            else:
                self._error(ex, 404, "not_found_error", f"no {path} here")

        def _messages(self, ex: Exchange, body: dict[str, Any]) -> None:
            try:
                admitted = server.rules.admit(body)
            except Refused as e:
                self._write(ex, e.status, "application/json", json.dumps(e.body).encode())
                return
            ex.label, reply = server.responder(body)
            ex.usage = admitted.usage(reply["content"])
            message = {
                "id": f"msg_bench_{len(server.exchanges)}",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "fake"),
                "stop_sequence": None,
                "usage": ex.usage,
                **reply,
            }
            # the response begins: what it cached is readable from now on (marked before the
            # write, so a client that has read it and asks again at once always finds it)
            server.rules.sent(admitted)
            if body.get("stream"):
                ex.stream = True
                self._write(ex, 200, "text/event-stream", sse(message))
            else:
                self._write(ex, 200, "application/json", json.dumps(message).encode())

    return Handler


@contextmanager
def serve(responder: Responder, rules: Messages | None = None) -> Iterator[FakeServer]:
    fake = FakeServer(responder) if rules is None else FakeServer(responder, rules=rules)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    fake.port = int(httpd.server_address[1])
    fake.base_url = f"http://127.0.0.1:{fake.port}"
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
