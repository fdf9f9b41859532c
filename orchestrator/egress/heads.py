"""What a sandbox asks the egress proxy, read strictly: one HTTP/1.x request head, either
``CONNECT host:port`` or a plain-HTTP request in absolute form (``GET http://host/...``;
``/path`` with a ``Host`` header is taken too). Anything else is a :class:`Refused` with
its status and the one line the client reads (:func:`refusal`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from .rules import normal_name, split_host_port

_METHOD = re.compile(r"[A-Z]{1,16}")  # what an event may keep of it


@dataclass(frozen=True)
class Request:
    method: str
    host: str
    port: int
    tunnel: bool
    forward: bytes = b""  # a plain-HTTP request's head as the server gets it


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def parse_head(head: bytes) -> Request:
    """The request a head asks for; :class:`Refused` (400) when it is no proxy request."""
    try:
        text = head.decode("latin-1")
        line, *headers = text[:-4].split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise Refused(400, "not an HTTP proxy request") from None
    if not version.startswith("HTTP/1.") or not _METHOD.fullmatch(method):
        raise Refused(400, "not an HTTP/1.x request (CONNECT host:port, or GET http://...)")
    if method == "CONNECT":
        host, port = split_target(target)
        return Request(method, host, port, tunnel=True)
    try:
        url = urlsplit(target)
        authority = url.netloc
    except ValueError:
        raise Refused(400, f"not a URL: {target[:100]!r}") from None
    if url.scheme not in ("http", "") or (url.scheme == "" and not target.startswith("/")):
        raise Refused(400, f"only http:// is proxied in the clear (use CONNECT for {url.scheme})")
    if not authority:
        hosts = [h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("host:")]
        authority = hosts[0] if hosts else ""
    host, port = split_target(authority, default=80)
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    hop = ("proxy-connection:", "proxy-authorization:", "connection:", "keep-alive:")
    kept = [h for h in headers if not h.lower().startswith(hop)]
    forward = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""])
    return Request(method, host, port, tunnel=False, forward=forward.encode("latin-1"))


def split_target(target: str, default: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as a normal name and a port; :class:`Refused` (400)."""
    try:
        host, written = split_host_port(target)
    except ValueError:
        raise Refused(400, f"not a host:port: {target[:100]!r}") from None
    port_text = written or (str(default) if default is not None else "")
    name = normal_name(host)
    digits = port_text.isascii() and port_text.isdigit()
    if name is None or not digits or not 0 < int(port_text) < 65536:
        raise Refused(400, f"not a host:port: {target[:100]!r}")
    return name, int(port_text)


def refusal(status: int, reason: str) -> bytes:
    word = HTTPStatus(status).phrase
    body = f"orch egress: {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {word}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nX-Orch-Egress: refused\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
