"""load_skill: the second half of progressive disclosure.

The system prompt lists each skill as one ``- name: description`` line; the
model calls ``load_skill`` with a name from that list to get the skill's full
instructions as a tool result. The name is looked up in the catalog, never
treated as a path.
"""

from __future__ import annotations

from pydantic import Field

from .base import Tool, ToolContext, ToolInput, ToolOutput


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

    async def run(self, ctx: ToolContext, args: LoadSkillInput) -> ToolOutput:
        skill = ctx.skills.get(args.name.strip())
        if skill is None:
            names = ", ".join(sorted(ctx.skills)) or "(none)"
            return ToolOutput(
                f"unknown skill {args.name!r}; available skills: {names}", is_error=True
            )
        return ToolOutput(skill.body)
