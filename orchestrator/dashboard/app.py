"""The dashboard's web app (Starlette): two pages, a JSON API, a stream, two actions.

- ``GET /`` and ``GET /run/{id}``: the same static page (``static/``); its script fetches
  the JSON and draws it, every model-written string as text (``textContent``), never markup.
- ``GET /api/runs``: the list (``views.runs``); ``GET /api/run/{id}``: one run whole.
- ``GET /api/stream``: server-sent events, one ``runs`` message per store change: the rows
  of the chains changed since the last look (``store.list_raw(since=…)``, which reads
  only those, and the live ones: a run's change changes its chain's totals), those not
  sent as they are already, looked for every ``POLL_S``.
- While the store is away (a server restarting, a file held locked), the API answers 503
  with ``{"error": <one line naming the store and what to do>}`` and the stream sends one
  ``store`` message ``{"state": "away", "error": …}``, tries again with backoff, and sends
  ``{"state": "back"}`` when the store answers (the page shows a banner meanwhile).
- ``POST /api/run/{id}/cancel``: ``orch cancel``'s path (``process/stopping.py``);
  ``POST /api/run/{id}/merge``: ``orch worktrees merge``'s, with its guards (control files
  refused, a dirty tree refused).

:class:`~.guard.Guard` stands in front of all of it (token, Host header, same-origin token).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..branches import merge
from ..errors import OrchError
from ..process.away import LAST_S, RETRYING, away
from ..process.stopping import cancel_tree
from ..run import RunRecord
from ..store import RunStore
from . import views
from .guard import Guard, csrf_for

T = TypeVar("T")
POLL_S = 0.05  # how often the stream looks for changes in the store
KEEPALIVE_S = 15.0
CANCEL_WAIT_S = 10.0


class StoreAway(Exception):
    """The store is away for now: ``line`` says so (the API answers 503 with it)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


async def _unavailable(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=503, headers={"retry-after": "2"})


def _said(state: str, **more: str) -> str:
    return f"event: store\ndata: {json.dumps({'state': state, **more})}\n\n"


def static_dir() -> Path:
    return Path(str(resources.files("orchestrator.dashboard").joinpath("static")))


class Dashboard:
    """The app of one project's store."""

    def __init__(self, store: RunStore, root: Path, token: str) -> None:
        self.store = store
        self.root = root
        # the store is read in one thread of its own, and acted on in another (a cancel
        # waits for the run to stop): each has its own connection, closed with the app
        self.reads = ThreadPoolExecutor(1, "orch-dashboard-read")
        self.acts = ThreadPoolExecutor(1, "orch-dashboard-act")
        self.page = (static_dir() / "index.html").read_text().replace("{{csrf}}", csrf_for(token))
        routes = [
            Route("/", self.index),
            Route("/run/{run_id}", self.index),
            Route("/api/runs", self.api_runs),
            Route("/api/run/{run_id}", self.api_run),
            Route("/api/stream", self.stream),
            Route("/api/run/{run_id}/cancel", self.cancel, methods=["POST"]),
            Route("/api/run/{run_id}/merge", self.merge, methods=["POST"]),
            Mount("/static", StaticFiles(directory=static_dir()), name="static"),
        ]
        app = Starlette(routes=routes, exception_handlers={StoreAway: _unavailable})
        self.guard = Guard(app, token)

    async def read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(…)`` in the read thread, tried once more at once if the store was away (a
        connection a server restart closed fails once); then StoreAway."""
        try:
            return await self._in(self.reads, lambda: fn(*args, **kwargs))
        except StoreAway:
            return await self._in(self.reads, lambda: fn(*args, **kwargs))

    async def act(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._in(self.acts, lambda: fn(*args))

    async def _in(self, pool: ThreadPoolExecutor, call: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        except Exception as e:
            if (line := away(e, self.store.describe())) is None:
                raise
            raise StoreAway(line) from None

    async def aclose(self) -> None:
        """Each thread's store connection closed in that thread, then the threads."""
        loop = asyncio.get_running_loop()
        for pool in (self.reads, self.acts):
            await loop.run_in_executor(pool, self.store.close)
            pool.shutdown(wait=True)

    # -- pages and reads ----------------------------------------------------------------
    async def index(self, request: Request) -> Response:
        headers = {
            "cache-control": "no-store",
            "content-security-policy": (
                "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
            ),
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        }
        return HTMLResponse(self.page, headers=headers)

    async def api_runs(self, request: Request) -> Response:
        show_all = request.query_params.get("all") == "1"
        data = await self.read(views.runs, self.store, show_all=show_all)
        return JSONResponse(data)

    def _record(self, run_id: str) -> RunRecord | None:
        return self.store.get_run(run_id)

    async def api_run(self, request: Request) -> Response:
        record = await self.read(self._record, request.path_params["run_id"])
        if record is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        data = await self.read(views.run, self.store, self.root, record)
        return JSONResponse(data)

    async def stream(self, request: Request) -> Response:
        now = time.time()
        try:
            since = float(request.query_params.get("since") or now)
        except ValueError:
            return JSONResponse({"error": "since must be a time in seconds"}, status_code=400)
        if not math.isfinite(since) or since < now - views.RECENT_S:
            since = now - views.RECENT_S  # a day back at most: the list's window

        async def changes() -> AsyncIterator[str]:
            last, seen, sent, quiet = since, dict[str, float](), dict[str, str](), 0.0
            down, delay = False, POLL_S  # the store away: said once, tried with backoff
            yield "retry: 1000\n\n"
            while not await request.is_disconnected():
                look = time.time()
                try:
                    rows = await self.read(views.changes, self.store, last - 1.0)
                    moved = [r for r in rows if seen.get(r["run_id"]) != r.get("updated_at")]
                    ids = sorted({str(r.get("chain_id")) for r in moved})
                    chains = await self.read(views.chains, self.store, ids) if ids else []
                except StoreAway as e:
                    if not down:
                        down = True
                        yield _said("away", error=f"{RETRYING} ({e.line})")
                    delay = min(delay * 2, LAST_S)
                    await asyncio.sleep(delay)
                    continue
                if down:
                    down, delay = False, POLL_S
                    yield _said("back")
                for r in moved:
                    seen[r["run_id"]] = r.get("updated_at") or 0.0
                fresh = []  # the rows of the chains that moved, those not sent as they are
                for r in chains:
                    said = json.dumps(r, sort_keys=True, default=str)
                    if sent.get(r["run_id"]) != said:
                        sent[r["run_id"]] = said
                        fresh.append(r)
                last = look
                if fresh:
                    quiet = 0.0
                    yield f"event: runs\ndata: {json.dumps(fresh, default=str)}\n\n"
                else:
                    quiet += POLL_S
                    if quiet >= KEEPALIVE_S:
                        quiet = 0.0
                        yield ": keepalive\n\n"
                await asyncio.sleep(POLL_S)

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(changes(), media_type="text/event-stream", headers=headers)

    # -- actions ------------------------------------------------------------------------
    async def cancel(self, request: Request) -> Response:
        record = await self.act(self._record, request.path_params["run_id"])
        if record is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        if record.status.ended:
            return JSONResponse({"run_id": record.run_id, "status": record.status.value})
        final = await self.act(cancel_tree, self.store, record, CANCEL_WAIT_S)
        mine = next((r for r in final if r.run_id == record.run_id), record)
        return JSONResponse({"run_id": record.run_id, "status": mine.status.value})

    async def merge(self, request: Request) -> Response:
        record = await self.act(self._record, request.path_params["run_id"])
        if record is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        branch = next(
            (str(a["branch"]) for a in record.artifacts if a.get("kind") == "branch"), None
        )
        if branch is None:
            return JSONResponse({"error": "this run left no branch"}, status_code=409)
        try:  # the CLI's guards: no control files, no dirty tree, no conflicts
            report = await self.act(merge, self.root, branch)
        except OrchError as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        data: dict[str, Any] = report.model_dump(mode="json")
        return JSONResponse(data)
