"""Store URLs, without a driver: which backend a URL names, and how to show it safely.

The settings (``store``), the trust digest and the store itself read these rules, so they
sit below all three (the store package imports the settings' layer, never the reverse).
:data:`BACKENDS` is the registry of store backends by URL scheme; a URL-less store is
SQLite in the project's state dir.

A ``postgresql://user:password@host:port/db?options`` URL may hold a password (in its
user part or as a ``password=`` option). Nothing orch prints, logs or records holds it:
messages name the store with :func:`redact` or :func:`endpoint`, and :func:`scrub` takes
the password out of any text that came from elsewhere (a driver's error message).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode

# scheme -> "module:class" of its RunStore, constructed with the URL; imported only when a
# URL of that scheme is used (a backend may need a driver: psycopg for Postgres)
BACKENDS: dict[str, str] = {
    "postgresql": "orchestrator.store.postgres:PostgresStore",
    "postgres": "orchestrator.store.postgres:PostgresStore",
}
SCHEMES = tuple(f"{scheme}://" for scheme in BACKENDS)
_SECRET_OPTIONS = {"password", "passfile", "sslpassword"}


def backend(url: str) -> str | None:
    """The ``module:class`` of the store a URL names, or None if orch has no such store."""
    scheme, sep, _ = url.strip().partition("://")
    return BACKENDS.get(scheme.lower()) if sep else None


def _split(url: str) -> tuple[str, str, str, str, str]:
    """scheme, userinfo, hosts, path, query of a URL (libpq allows ``h1:p1,h2:p2`` hosts)."""
    scheme, _, rest = url.strip().partition("://")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    return scheme, userinfo if at else "", hosts, slash + path, query


def passwords(url: str) -> list[str]:
    """Every password the URL holds, as written and decoded (for :func:`scrub`)."""
    _, userinfo, _, _, query = _split(url)
    found = []
    if ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    found += [v for k, v in parse_qsl(query, keep_blank_values=True) if k in _SECRET_OPTIONS]
    both = {p for raw in found for p in (raw, unquote(raw)) if p}
    return sorted(both, key=len, reverse=True)


def redact(url: str) -> str:
    """The URL without its password (user part and ``password=`` options dropped)."""
    scheme, userinfo, hosts, path, query = _split(url)
    user = userinfo.partition(":")[0]
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k not in _SECRET_OPTIONS]
    tail = f"?{urlencode(kept)}" if kept else ""
    return f"{scheme}://{user + '@' if user else ''}{hosts}{path}{tail}"


def endpoint(url: str) -> str:
    """``host:port`` of the URL (libpq's defaults where it names none), for messages."""
    _, _, hosts, _, query = _split(url)
    options = dict(parse_qsl(query))
    if not hosts:
        host = options.get("host", "localhost")
        return f"{host}:{options.get('port', '5432')}"
    return ",".join(_with_port(h, options.get("port", "5432")) for h in hosts.split(","))


def _with_port(host: str, port: str) -> str:
    has_port = "]:" in host if host.startswith("[") else ":" in host
    return host if has_port else f"{host}:{port}"


def local_paths(url: str) -> list[str]:
    """The local files a URL reaches its server through or with: Unix-socket directories (a
    host, in the host part or a ``host=`` option, that is an absolute path) and the
    ``passfile``, ``sslkey`` and ``sslcert`` it names. A sandbox must not reach them."""
    _, _, hosts, _, query = _split(url)
    options = parse_qsl(query)
    named = [unquote(h) for h in hosts.split(",") if h]
    named += [h for k, v in options if k == "host" for h in v.split(",")]
    files = [v for k, v in options if k in ("passfile", "sslkey", "sslcert") and v]
    return [h for h in named if h.startswith("/")] + files


def scrub(text: str, url: str) -> str:
    """``text`` with every password of ``url`` replaced by ``***``."""
    for secret in passwords(url):
        text = text.replace(secret, "***")
    return text
