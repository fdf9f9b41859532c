"""Lifetimes that finish what they start: an opening or a closing runs to its end even when
the caller is cancelled meanwhile (a half-made worktree or container is never left behind).

:func:`await_shielded` is the one way to do that; :class:`Shielded` is the ``async with``
shape built on it, shared by the workspaces and the container pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from types import TracebackType
from typing import Self, TypeVar

T = TypeVar("T")


async def await_shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to completion even if the caller is cancelled meanwhile, then re-cancel."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                cancelled = True
        except BaseException:
            break
    if cancelled and not task.cancelled() and task.exception() is None:
        raise asyncio.CancelledError
    return task.result()


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
