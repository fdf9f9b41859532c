"""Who may use the dashboard: the holder of its token, from this machine, by its own pages.

The dashboard answers only on loopback, and only to a request that

- names it in its ``Host`` header (``127.0.0.1:PORT``, ``localhost:PORT``, ``[::1]:PORT``):
  a page of another site whose name was made to resolve to 127.0.0.1 (DNS rebinding)
  sends its own name, and is refused (403);
- carries the token: ``?token=`` (the URL ``orch dashboard`` prints), or a one-time code
  (``?code=``, the page ``orch dashboard`` opens the browser on: redeemed once, within
  ``CODE_TTL_S``, then refused, and the page removed) opens a session, an
  HttpOnly, SameSite=Strict cookie named with the port, holding a random session id, not
  the token (cookies ignore ports: another server on 127.0.0.1 the browser visits is sent
  it), and the token leaves the address bar; then the cookie, or ``Authorization:
  Bearer`` with the token. None: 401; a wrong one: 403;
- and, for an action (any method but GET and HEAD), also carries the page's same-origin
  token in ``X-Orch-Csrf`` and, when the browser says where it comes from, an ``Origin``
  that is the dashboard's own: another page cannot act in the user's name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "orch_dashboard"  # and the port: two dashboards keep a cookie each
ENTRY_TARGET = re.compile(r"/(run/[A-Za-z0-9_-]{1,64})?")  # where the entry may send the browser
CSRF_HEADER = b"x-orch-csrf"
SAFE_METHODS = ("GET", "HEAD")
CODE_TTL_S = 120.0  # a browser opens the page at once


def csrf_for(token: str) -> str:
    """The same-origin token of a dashboard's pages (given only to a holder of ``token``)."""
    return hmac.new(token.encode(), b"orch-dashboard-csrf", hashlib.sha256).hexdigest()


def same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Guard:
    """ASGI middleware in front of every page, API call and stream of the dashboard."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self.csrf = csrf_for(token)
        self.hosts: set[str] = set()  # set once the port is known (``allow_port``)
        self.cookie = COOKIE
        # a browser's cookie holds a session of its own, never the token: what another
        # server on 127.0.0.1 may be sent (cookies ignore ports) is not the printed URL's key
        self.sessions: set[str] = set()
        # one-time codes (a secret handed to a browser through a file is single-use)
        self.codes: dict[str, tuple[float, Callable[[], None]]] = {}

    def one_time_code(self, redeemed: Callable[[], None] = lambda: None) -> str:
        """A code that opens one session, once, within ``CODE_TTL_S``; ``redeemed`` runs
        when it is used (the opener page goes)."""
        code = secrets.token_urlsafe(32)
        self.codes[code] = (time.monotonic() + CODE_TTL_S, redeemed)
        return code

    def _redeem(self, given: str) -> bool:
        for code, (until, redeemed) in list(self.codes.items()):
            if same(given, code):
                del self.codes[code]
                redeemed()
                return time.monotonic() < until
        return False

    def allow_port(self, port: int, host: str = "127.0.0.1") -> None:
        shown = f"[{host}]" if ":" in host else host
        self.hosts = {f"{shown}:{port}", f"localhost:{port}"}
        self.cookie = f"{COOKIE}_{port}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:  # every answer: no sniffing, no caching
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                ]
            await send(message)

        await self._check(scope, receive, guarded)

    async def _check(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if headers.get("host") not in self.hosts:
            await refuse(send, 403, "unknown Host header: open the URL orch dashboard printed")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given_code = (query.get("code") or [None])[0]
        if given_code is not None:
            if not self._redeem(given_code):
                await refuse(
                    send,
                    403,
                    "this link was used already (or is old): open the URL orch dashboard printed",
                )
                return
            await self._enter(send, scope.get("path", "/"))
            return
        given_query = (query.get("token") or [None])[0]
        if given_query is not None:
            if not same(given_query, self.token):
                await refuse(send, 403, "wrong token: open the URL orch dashboard printed")
                return
            await self._enter(send, scope.get("path", "/"))
            return
        session = cookie_parser(headers.get("cookie", "")).get(self.cookie)
        auth = headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if session is None and bearer is None:
            await refuse(send, 401, "no token: open the URL orch dashboard printed")
            return
        known = session is not None and any(same(session, s) for s in self.sessions)
        if not known and not (bearer is not None and same(bearer, self.token)):
            await refuse(send, 403, "wrong token: open the URL orch dashboard printed")
            return
        if scope["method"] not in SAFE_METHODS:
            origin = headers.get("origin")
            if origin is not None and origin.removeprefix("http://") not in self.hosts:
                await refuse(send, 403, "an action from another origin")
                return
            if not same(headers.get(CSRF_HEADER.decode()), self.csrf):
                await refuse(send, 403, "an action without the page's token")
                return
        await self.app(scope, receive, send)

    async def _enter(self, send: Send, path: str) -> None:
        """The token in the URL opens a session, the browser's cookie; the address bar
        loses the token; the browser goes to a page of the dashboard's, never elsewhere."""
        session = secrets.token_urlsafe(32)
        self.sessions.add(session)
        cookie = f"{self.cookie}={session}; HttpOnly; SameSite=Strict; Path=/"
        target = path if ENTRY_TARGET.fullmatch(path) else "/"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", target.encode("latin-1", "replace")),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


async def refuse(send: Send, status: int, why: str) -> None:
    body: Any = json.dumps({"error": why}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
