"""A fake Chat Completions API on loopback, driven through the real `openai` SDK.

``POST .../chat/completions``: each request is recorded with its headers; a ``responder``
decides the reply from the request body (:func:`text_reply`, :func:`tool_reply`). Usage is
counted from the request's size (its JSON characters / 4), with OpenAI's automatic prefix
caching: a prompt of 1024 tokens or more reads from the cache the longest prefix it shares
with an earlier prompt of the same key and model, in 128-token steps, reported as
``prompt_tokens_details.cached_tokens``. A ``window`` refuses a longer prompt with the
API's own ``context_length_exceeded`` body; ``key`` refuses any other key with a 401; faults
(a status, or a dropped connection) can be injected for the first N requests.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Responder = Callable[[dict[str, Any]], dict[str, Any]]
CACHE_MIN = 1024  # tokens: a shorter prompt is never cached
CACHE_STEP = 128  # a cached prefix grows in steps of this many tokens


def text_reply(text: str) -> dict[str, Any]:
    return {"content": text, "finish_reason": "stop"}


def tool_reply(*calls: tuple[str, Any], text: str | None = None) -> dict[str, Any]:
    """Tool calls (a name and its input: an object, or a string sent as the raw
    ``arguments``), all in one reply (parallel tool calls)."""
    tool_calls = [
        {
            "id": f"call_{random.getrandbits(40):x}_{i}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
        for i, (name, args) in enumerate(calls)
    ]
    return {"content": text, "tool_calls": tool_calls, "finish_reason": "tool_calls"}


def system_text(body: dict[str, Any]) -> str:
    return "".join(
        m["content"]
        for m in body.get("messages", [])
        if m.get("role") == "system" and isinstance(m.get("content"), str)
    )


def prompt_text(body: dict[str, Any]) -> str:
    """What the prompt is made of, in the order a cache sees it: the tools, then each
    message."""
    parts = [json.dumps(body.get("tools", []), sort_keys=True)]
    parts += [json.dumps(m, sort_keys=True) for m in body.get("messages", [])]
    return "".join(parts)


def tokens(text: str) -> int:
    return len(text) // 4


def cached_tokens(prompt: str, seen: list[str]) -> int:
    """OpenAI's rule: prompts of 1024 tokens or more are cached; a hit is the longest prefix
    shared with an earlier prompt, counted in 128-token steps."""
    if tokens(prompt) < CACHE_MIN or not seen:
        return 0
    shared = max(tokens(os.path.commonprefix([prompt, s])) for s in seen)
    if shared < CACHE_MIN:
        return 0
    return min(shared // CACHE_STEP * CACHE_STEP, tokens(prompt))


def overflow(window: int, prompt: int) -> dict[str, Any]:
    return {
        "error": {
            "message": (
                f"This model's maximum context length is {window} tokens. However, your "
                f"messages resulted in {prompt} tokens. Please reduce the length of the "
                "messages."
            ),
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


def error(message: str, kind: str = "server_error", code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass
class FakeChat:
    responder: Responder
    key: str | None = None  # the one key it takes (a 401 for any other); None: any
    window: int | None = None  # tokens; a longer prompt is refused as OpenAI does
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    # (request, usage) of each request answered 200: what the answer reported
    answered: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    fail_first: int = 0
    faults: tuple[int, ...] = (429, 500, 503, 0)  # 0: drop the connection
    fail_with: dict[str, Any] | None = None  # the body of an injected status
    served: int = 0
    seen: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (key, model)
    lock: threading.Lock = field(default_factory=threading.Lock)
    base_url: str = ""  # http://127.0.0.1:PORT/v1

    def fault(self) -> int | None:
        with self.lock:
            self.served += 1
            n = self.served
        return self.faults[(n - 1) % len(self.faults)] if n <= self.fail_first else None

    def answer(self, body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any]]:
        if self.key is not None and auth != f"Bearer {self.key}":
            given = auth.removeprefix("Bearer ")
            shown = f"{given[:3]}...{given[-4:]}" if len(given) > 8 else given
            return 401, error(
                f"Incorrect API key provided: {shown}.", "invalid_request_error", "invalid_api_key"
            )
        prompt = prompt_text(body)
        size = tokens(prompt)
        if self.window is not None and size > self.window:
            return 400, overflow(self.window, size)
        with self.lock:
            seen = self.seen.setdefault((auth, str(body.get("model"))), [])
            cached = cached_tokens(prompt, seen)
            seen.append(prompt)
        reply = self.responder(body)
        message = {"role": "assistant", "content": reply.get("content")}
        if reply.get("tool_calls"):
            message["tool_calls"] = reply["tool_calls"]
        out = tokens(json.dumps(message))
        usage = {
            "prompt_tokens": size,
            "completion_tokens": out,
            "total_tokens": size + out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        with self.lock:
            self.answered.append((body, usage))
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "fake"),
            "choices": [
                {"index": 0, "message": message, "finish_reason": reply.get("finish_reason")}
            ],
            "usage": usage,
        }


def _handler(api: FakeChat) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            headers = {k.lower(): v for k, v in self.headers.items()}
            with api.lock:
                api.requests.append(body)
                api.headers.append(headers)
            if not self.path.endswith("/chat/completions"):
                self._send(404, error(f"no route {self.path}", "invalid_request_error"))
                return
            fault = api.fault()
            if fault == 0:
                self.close_connection = True
                self.connection.close()
                return
            if fault is not None:
                self._send(fault, api.fail_with or error("injected"), {"retry-after-ms": "10"})
                return
            self._send(*api.answer(body, headers.get("authorization", "")))

        def _send(
            self, code: int, data: dict[str, Any], extra: dict[str, str] | None = None
        ) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(raw)

    return Handler


@contextmanager
def serve(api: FakeChat) -> Iterator[FakeChat]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
