"""A fake Anthropic Messages API on loopback, driven through the real `anthropic` SDK.

Each request is recorded; a ``responder`` decides the reply from the request
body. Usage is the real API's (``orchestrator.testing.messages``): input tokens from the
request, prompt-cache reads and writes by the documented prefix rules, and a prompt over
the model's window refused with the real 400 (``set_window``; ``clock`` drives the cache's
TTLs). Faults can be injected: a status code (429, 500, 529) or a dropped
connection, for the first N requests or a fraction of them.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orchestrator.testing.messages import Admitted, Messages, Refused

Responder = Callable[[dict[str, Any]], dict[str, Any]]


def system_text(body: dict[str, Any]) -> str:
    """A request's system prompt as one text (a string, or text blocks: the cached part and
    the run's own facts)."""
    system = body.get("system")
    if isinstance(system, list):
        return "".join(b.get("text", "") for b in system if isinstance(b, dict))
    return system if isinstance(system, str) else ""


def plain(value: Any) -> Any:
    """``value`` (a request body, its messages...) without prompt-cache markers, and a
    message's string content as its one text block (a marked message is sent so): what the
    agent loop holds and stores, in one form."""
    if isinstance(value, dict):
        if "role" in value and isinstance(value.get("content"), str):
            value = {**value, "content": [{"type": "text", "text": value["content"]}]}
        return {k: plain(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def text_reply(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "stop_reason": "end_turn"}


def tool_reply(*calls: tuple[str, dict[str, Any]], text: str = "") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for i, (name, args) in enumerate(calls):
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{random.getrandbits(40):x}_{i}",
                "name": name,
                "input": args,
            }
        )
    return {"content": content, "stop_reason": "tool_use"}


@dataclass
class FakeAPI:
    responder: Responder
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    fault_rate: float = 0.0
    faults: tuple[int, ...] = (429, 500, 529, 0)  # 0: drop the connection
    fail_first: int = 0
    delay_s: float = 0.0  # every answer waits this long (slow responses)
    seed: int = 7
    served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    base_url: str = ""
    windows: dict[str, int] = field(default_factory=dict)  # model id -> its context window
    clock: Callable[[], float] | None = None  # the prompt cache's clock (time.monotonic)
    # the usage each request was answered with, by the index of ``requests`` (None: refused)
    usages: list[dict[str, Any] | None] = field(default_factory=list)
    rules: Messages = field(init=False)

    def __post_init__(self) -> None:
        self.rules = Messages(clock=self.clock, windows=self.windows)

    def set_window(self, model: str, tokens: int) -> None:
        """The context window of ``model``: a longer prompt is refused as the API does."""
        self.rules.set_window(model, tokens)

    def answered(self) -> list[dict[str, Any]]:
        """The usage of every request answered (in the order they were received)."""
        with self.lock:
            return [u for u in self.usages if u is not None]

    def decide_fault(self, rng: random.Random) -> int | None:
        with self.lock:
            self.served += 1
            n = self.served
        if n <= self.fail_first:
            return self.faults[(n - 1) % len(self.faults)]
        if self.fault_rate and rng.random() < self.fault_rate:
            return rng.choice(self.faults)
        return None


def _handler(api: FakeAPI) -> type[BaseHTTPRequestHandler]:
    rng = random.Random(api.seed)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            fault = api.decide_fault(rng)
            if fault == 0:
                self.close_connection = True
                self.connection.close()
                return
            if fault is not None:
                err = {
                    "type": "error",
                    "error": {"type": "overloaded_error", "message": "injected"},
                }
                self._send(fault, err, {"retry-after-ms": "10"})
                return
            with api.lock:
                index = len(api.requests)
                api.requests.append(body)
                api.headers.append({k.lower(): v for k, v in self.headers.items()})
                api.usages.append(None)
            try:
                admitted = api.rules.admit(body)
            except Refused as e:
                self._send(e.status, e.body, {"request-id": e.body["request_id"]})
                return
            if api.delay_s:
                time.sleep(api.delay_s)
            reply = api.responder(body)
            usage = admitted.usage(reply.get("content"))
            with api.lock:
                api.usages[index] = usage
            message = {
                "id": f"msg_{index + 1}",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "fake"),
                "stop_sequence": None,
                "usage": usage,
                **reply,
            }
            self._send(200, message, {"request-id": admitted.request_id}, admitted)

        def _send(
            self,
            code: int,
            data: dict[str, Any],
            extra: dict[str, str] | None = None,
            admitted: Admitted | None = None,
        ) -> None:
            """Answer; what ``admitted`` caches is readable once the answer begins (the API's
            rule; marked before the body goes, so a client that has read it and asks again at
            once always finds it)."""
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            if admitted is not None:
                api.rules.sent(admitted)
            self.end_headers()
            self.wfile.write(raw)
            self.wfile.flush()

    return Handler


@contextmanager
def serve(api: FakeAPI) -> Iterator[FakeAPI]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def served(responder: Responder, monkeypatch: Any) -> Iterator[FakeAPI]:
    """The fake API on loopback, named by the environment (a child process's too)."""
    with serve(FakeAPI(responder)) as running:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", running.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")
        yield running
