"""The bash tool: one command line in the agent's workspace (host or container)."""

from __future__ import annotations

from pydantic import Field

from ..config import Settings
from ..run import CommandEvidence
from .base import Tool, ToolContext, ToolInput, ToolOutput


class BashInput(ToolInput):
    command: str = Field(min_length=1, description="The bash command line to run.")
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="Seconds before the command is killed (default 120).",
    )


class BashTool(Tool):
    name = "bash"
    description = (
        "Run a bash command in the workspace root and return its combined stdout/stderr and "
        "exit code. The whole process group is killed at the timeout; processes left in the "
        "background are stopped when the command returns. No interactive input."
    )
    input_model = BashInput
    writes = True

    def time_limit(self, args: BashInput, settings: Settings) -> float | None:
        return (args.timeout_s or settings.bash_timeout_s) + 15.0

    async def run(self, ctx: ToolContext, args: BashInput) -> ToolOutput:
        timeout = args.timeout_s or ctx.settings.bash_timeout_s
        result = await ctx.runtime.exec(args.command, timeout_s=timeout, env=ctx.env)
        ctx.evidence.commands.append(
            CommandEvidence(command=args.command[:500], exit_code=result.exit_code)
        )
        text = result.output
        if result.truncated_bytes:
            text += f"\n[{result.truncated_bytes} more bytes of output dropped]"
        if result.timed_out:
            return ToolOutput(
                f"{text}\n[killed: command still running after {timeout:g}s]", is_error=True
            )
        return ToolOutput(f"{text}\n[exit code {result.exit_code}]", is_error=result.exit_code != 0)
