"""Tools the model can call. Names and inputs are a contract: agent files depend on them."""

from __future__ import annotations

from .base import Tool, ToolFailure, ToolInput, ToolOutput, ToolRegistry
from .files import EditFileTool, GlobTool, GrepTool, ReadFileTool, WriteFileTool
from .shell import BashTool

__all__ = ["Tool", "ToolFailure", "ToolInput", "ToolOutput", "ToolRegistry", "builtin_tools"]


def builtin_tools() -> list[Tool]:
    """Every tool except the delegation ones (those live in ``delegation.py``)."""
    from .skills import LoadSkillTool

    return [
        BashTool(),
        ReadFileTool(),
        WriteFileTool(),
        EditFileTool(),
        GlobTool(),
        GrepTool(),
        LoadSkillTool(),
    ]
