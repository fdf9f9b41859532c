"""Lifetimes that finish what they start: an opening or a closing runs to its end even when
the caller is cancelled meanwhile (a half-made worktree or container is never left behind).

:func:`await_shielded` is the one way to do that; :class:`Shielded` is the ``async with``
shape built on it, shared by the workspaces and the container pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, Self, TypeVar

T = TypeVar("T")


async def await_shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to completion even if the caller is cancelled meanwhile, then re-cancel.

    The caller was cancelled when its count of cancel requests grew, not when the shield
    raised: ``aw`` may end in the very turn the cancel arrives (a shield that raises for an
    ``aw`` already done is a cancel of ours all the same; taken for its end, it was lost)."""
    task = asyncio.ensure_future(aw)
    current = asyncio.current_task()
    asked = current.cancelling() if current is not None else 0
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    if current is not None and current.cancelling() > asked:
        if not task.cancelled() and task.exception() is None:
            raise asyncio.CancelledError
    return task.result()


async def stopped(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait for them to end. Unlike ``task.cancel()`` and an ``await``
    that suppresses ``CancelledError``, a cancel of the caller meanwhile is not taken for
    theirs: it is raised, once they have ended."""
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    await await_shielded(asyncio.wait(tasks))  # they end before the caller's cancel goes on
    for task in tasks:
        if not task.cancelled():
            task.exception()  # (retrieved: an error on the way out is not logged as lost)


class Shielded:
    """``async with`` around :meth:`_open` and :meth:`_shut`, each shielded from cancellation;
    an opening that fails (or is cancelled) is undone by :meth:`_undo` before it raises."""

    async def _open(self) -> None:
        return None

    async def _undo(self) -> None:
        return None

    async def _shut(self, exc_type: type[BaseException] | None) -> None:
        return None

    async def __aenter__(self) -> Self:
        try:
            await await_shielded(self._open())
        except BaseException:
            await await_shielded(self._undo())
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await await_shielded(self._shut(exc_type))
