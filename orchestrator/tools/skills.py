"""load_skill: the second half of progressive disclosure.

The system prompt lists each skill as one ``- name: description`` line; the
model calls ``load_skill`` with a name from that list to get the skill's full
instructions as a tool result. The name is looked up in the catalog, never
treated as a path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from ..definitions import UnknownSkill
from .base import Tool, ToolInput, ToolOutput

if TYPE_CHECKING:
    from ..agent import RunContext


class LoadSkillInput(ToolInput):
    name: str = Field(description="The skill's name, exactly as listed in the skills catalog.")


class LoadSkillTool(Tool):
    name = "load_skill"
    description = (
        "Return the full instructions of a skill, by its name in the skills catalog of your "
        "system prompt. Load a skill when its description matches the task at hand, before "
        "starting the work it covers, and follow its instructions."
    )
    input_model = LoadSkillInput
    read_only = True

    async def run(self, ctx: RunContext, args: LoadSkillInput) -> ToolOutput:
        try:
            skill = ctx.catalog.skill(args.name.strip())
        except UnknownSkill:
            names = ", ".join(sorted(ctx.catalog.skills)) or "(none)"
            return ToolOutput(
                f"unknown skill {args.name!r}; available skills: {names}", is_error=True
            )
        return ToolOutput(skill.body)
