"""Errors that reach the user as one line and an exit code, never a traceback."""

from __future__ import annotations


class OrchError(Exception):
    """Base: the message is a complete sentence telling the user what to do."""

    exit_code = 1


class UsageError(OrchError):
    exit_code = 2


class NotFound(OrchError):
    exit_code = 2
