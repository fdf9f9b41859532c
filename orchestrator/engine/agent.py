"""AgentRun: the loop. messages → model → tool calls → tool_results → … until done.

A run ends when a response has no tool use (its text is the final answer) or
``max_turns`` is reached. Tool calls of one response run concurrently; their
results go back in call order. Every call goes through the policy and the
PreToolUse / PostToolUse hooks first; a refused call runs nothing. A malformed
call (no name, a name or an input of the wrong type, a missing or repeated id) is
answered with a tool error, never an exception, and the stored conversation stays
one the Messages API accepts (see ``calls.CallLedger.turn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..catalog.guidance import environment_section, task_description
from ..config import Settings
from ..models import pricing
from ..models.base import (
    Block,
    ContextOverflow,
    Message,
    Model,
    ModelRequest,
    ModelUsage,
    clean_text,
)
from ..policy.checks import Policy, run_hooks
from ..run import Evidence, RunRecord, RunStatus, Usage
from ..store import RunStore
from ..tools.base import ToolContext, ToolFailure, ToolOutput, ToolRegistry
from .budget import exhausted
from .calls import (
    MAX_PROBLEMS,
    MISSING,
    NAME_SHOWN,
    CallLedger,
    ToolCall,
    capped,
    json_kind,
    shown_name,
    summarize_input,
)
from .context import ContextKeeper, fit
from .conversation import CONTINUE, continued, cut, text_event, tool_use_ids
from .memory import MemorySource, load_memory

if TYPE_CHECKING:
    from ..catalog.definitions import AgentDefinition, Catalog


@dataclass
class RunContext:
    """One run as its loop sees it. Made by the Runner; tools get only ``tool_ctx``."""

    record: RunRecord
    definition: AgentDefinition
    settings: Settings
    store: RunStore
    model: Model
    tools: ToolRegistry
    policy: Policy
    catalog: Catalog
    tool_ctx: ToolContext
    usage: Usage = field(default_factory=Usage)
    # Texts to hand the model with its next request (background-child notifications).
    notifications: list[str] = field(default_factory=list)
    # Tool calls (and waits for children) under way: a run busy with them is not stalled.
    inflight: int = 0
    # Where hooks run on the host: the workspace's host directory (for a container, the
    # user's checkout: a hook never runs in a tree a sandbox writes). None: ``root``.
    host_root: Path | None = None
    # Where the run's memory files come from, found once for the directory it was spawned
    # from (``Runner.memory``). None: no project memory (``project_memory = false``).
    memory: MemorySource | None = None

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def model_name(self) -> str:
        return self.record.model

    @property
    def evidence(self) -> Evidence:
        return self.tool_ctx.evidence

    @property
    def env(self) -> dict[str, str]:
        return dict(self.tool_ctx.env)

    @property
    def root(self) -> Path:
        return self.tool_ctx.runtime.root

    @property
    def hook_cwd(self) -> Path:
        return self.host_root or self.root


@dataclass
class LoopOutcome:
    status: RunStatus
    text: str
    error: str | None = None
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # a driver's own


OFF_LOOP_CHECK_CHARS = 2048  # a bash command longer than this is checked in a thread


class AgentRun:
    def __init__(
        self,
        ctx: RunContext,
        *,
        max_turns: int,
        before_finish: Callable[[RunContext], Awaitable[bool]] | None = None,
        on_progress: Callable[[], None] | None = None,
        ahead: Callable[[list[ToolCall]], AbstractAsyncContextManager[object]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.on_progress = on_progress or (lambda: None)
        # Around a reply's calls, seen before they run (containers for its children start).
        self.ahead = ahead or (lambda _: contextlib.nullcontext())
        self.max_turns = max_turns
        # Returns True when the run must go on (e.g. background children delivered results).
        self.before_finish = before_finish
        self.messages: list[Message] = []
        self.last_text = ""
        self.cut_parts: list[str] = []  # a final answer cut at max_tokens, in pieces
        self.ledger = CallLedger()  # the tool_use ids of the conversation, each used once

    def system_prompt(self, memory: str = "") -> tuple[str, int]:
        """The agent's own prompt, project memory (``memory.py``) and skills, then its tier's
        facts; and the length of the part before those facts. That part is the same for every
        run of the agent in the project (the prompt cache's stable prefix: siblings share
        it); the facts name the run's own root, branch, depth and network."""
        ctx = self.ctx
        d = ctx.definition
        parts = [d.system_prompt.strip() or "You are a capable coding agent."]
        if memory:
            parts.append(memory)
        offered = ctx.policy.offered_tools()
        if "load_skill" in offered and ctx.catalog.skills:
            parts.append(
                "\n# Skills\nLoad one with load_skill when it applies:\n"
                + ctx.catalog.skill_catalog_text()
            )
        for name in d.skills:
            if name in ctx.catalog.skills:
                parts.append(f"\n# Skill: {name}\n{ctx.catalog.skills[name].body}")
        stable = "\n".join(parts)
        facts = environment_section(
            root=ctx.root,
            isolation=ctx.record.isolation,
            agent=d.name,
            depth=ctx.record.depth,
            max_depth=ctx.record.max_depth,
            workspace=ctx.record.workspace,
        )
        return f"{stable}\n{facts}", len(stable) + 1

    async def run(self, prompt: str, history: list[Message] | None = None) -> LoopOutcome:
        """Run to a final answer. A fresh conversation has the prompt as its one and only
        first message; a resumed one (``history``: a stored transcript) goes on with the
        prompt as its next user message."""
        ctx = self.ctx
        self.messages = continued(history, prompt) if history else []
        self.messages = self.messages or [{"role": "user", "content": prompt}]
        self.ledger = CallLedger()
        self.ledger.tool_use_ids.update(tool_use_ids(self.messages))
        # read here, not in a thread: at most three small regular files (≈ 0.2 ms), and a
        # hundred children's thread hops cost their fan-out more than the reads
        memory = load_memory(ctx.memory) if ctx.memory is not None else ""
        system, stable_chars = self.system_prompt(memory)
        cache_ttl = ctx.definition.cache_ttl or ctx.settings.cache_ttl
        tools = ctx.tools.schemas(ctx.policy.offered_tools())
        for i, schema in enumerate(tools):  # the task tool names the agents this run may start
            if schema["name"] == "task":
                tools[i] = {**schema, "description": task_description(ctx.catalog, ctx.definition)}
        shell = "bash" in ctx.policy.offered_tools()
        s = ctx.settings.context
        keeper = ContextKeeper(
            window=pricing.window(ctx.model_name, s.windows),
            compact_at=s.compact_at,
            keep_tool_results=s.keep_tool_results,
        )

        def build(view: list[Message]) -> ModelRequest:
            return ModelRequest(
                system=system,
                messages=view,
                tools=tools,
                model=ctx.model_name,
                max_tokens=ctx.settings.max_tokens,
                agent=ctx.definition.name,
                run_id=ctx.run_id,
                depth=ctx.record.depth,
                stable_chars=stable_chars,
                cache_ttl=cache_ttl,
            )

        turns = 0
        while True:
            if turns >= self.max_turns:
                return LoopOutcome(
                    RunStatus.FAILED,
                    self.last_text,
                    f"max_turns ({self.max_turns}) reached before a final answer",
                )
            self._deliver_notifications()
            turns += 1
            if shell:  # the model thinks: the sandbox of a command it may send is made meanwhile
                ctx.tool_ctx.runtime.expect(ctx.tool_ctx.env)
            if (spent := exhausted(ctx.store, ctx.record, ctx.usage)) is not None:
                return LoopOutcome(RunStatus.FAILED, self.last_text, spent)
            request = build(keeper.view(self.messages))
            if keeper.over(request):
                await self._fit(keeper, build, turns, refused=False)
                request = build(keeper.view(self.messages))
            started = time.monotonic()
            try:
                response = await ctx.model.complete(request)
            except ContextOverflow:  # recovered from once: cleared and compacted, sent again
                if not await self._fit(keeper, build, turns, refused=True):
                    raise
                request = build(keeper.view(self.messages))
                response = await ctx.model.complete(request)
            self.on_progress()
            keeper.note(request, response.usage)
            ctx.usage.turns = turns
            self._charge(response.usage, cache_ttl, turns, time.monotonic() - started)
            ctx.usage.context_tokens = response.usage.prompt_tokens
            content, calls = self.ledger.turn(response.content)
            self.messages.append({"role": "assistant", "content": content})
            if response.text:
                self.last_text = response.text
                ctx.store.add_event(ctx.run_id, "assistant_text", text_event(turns, response.text))
            ctx.store.patch_run(
                ctx.run_id, usage=ctx.usage.model_copy(), summary=self.last_text[:2000]
            )
            if not calls and response.stop_reason == "max_tokens":
                # The answer was cut at the output limit: ask for the rest, keep the part.
                self.cut_parts.append(response.raw_text)
                self.messages.append({"role": "user", "content": CONTINUE})
                self._save()
                continue
            if not calls:
                self._save()
                if self.before_finish is not None and await self.before_finish(ctx):
                    self.messages.append({"role": "user", "content": self._take_notes()})
                    continue
                final = "".join(self.cut_parts) + response.text
                self.cut_parts.clear()
                return LoopOutcome(RunStatus.SUCCEEDED, final)
            async with self.ahead(calls):
                results = await asyncio.gather(*(self._call(c) for c in calls))
            self.messages.append({"role": "user", "content": list(results)})
            self._save()

    def _charge(self, usage: ModelUsage, ttl: str, turn: int, seconds: float) -> None:
        """Add one request's tokens and dollars to the run's usage; its ``model_usage``
        event keeps them per request (what a trace or a bill is made from)."""
        u, ctx = self.ctx.usage, self.ctx
        cost = pricing.cost(ctx.model_name, usage, ttl=ttl, prices=ctx.settings.prices)
        u.input_tokens += usage.input_tokens
        u.output_tokens += usage.output_tokens
        u.cache_creation_input_tokens += usage.cache_creation_input_tokens
        u.cache_read_input_tokens += usage.cache_read_input_tokens
        u.cost_usd += cost
        event = {
            "turn": turn,
            "input_tokens": usage.input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "output_tokens": usage.output_tokens,
            "cost_usd": cost,
            "ms": round(seconds * 1000, 1),
        }
        ctx.store.add_event(ctx.run_id, "model_usage", event)

    async def _fit(
        self,
        keeper: ContextKeeper,
        build: Callable[[list[Message]], ModelRequest],
        turn: int,
        *,
        refused: bool,
    ) -> bool:
        """Clear or compact the conversation's view (``context.py``); False: nothing could
        be. The whole conversation is kept (and stored) as it was."""
        ttl = build([]).cache_ttl
        done = await fit(
            keeper,
            self.ctx.model,
            self.messages,
            build,
            refused=refused,
            on_usage=lambda usage: self._charge(usage, ttl, turn, 0.0),
        )
        if done is None:
            return False
        self.ctx.usage.compactions += 1
        self.ctx.store.add_event(self.ctx.run_id, "context_compacted", done.event(turn))
        return True

    def _save(self) -> None:
        """Keep the conversation (for resume) at a point it is whole: after a final reply,
        or after the tool results of a reply; a crash leaves the last whole turn."""
        if self.ctx.settings.transcript_retention_days > 0:
            self.ctx.store.save_transcript(self.ctx.run_id, self.messages)

    def _take_notes(self) -> list[Block]:
        # emptied in place: the spawner (and a team's messages) keep appending to this list
        notes = list(self.ctx.notifications)
        self.ctx.notifications.clear()
        return [{"type": "text", "text": n} for n in notes] or [
            {"type": "text", "text": "(no new notifications)"}
        ]

    def _deliver_notifications(self) -> None:
        if not self.ctx.notifications:
            return
        last = self.messages[-1]
        if last["role"] != "user":
            return
        content = last["content"]
        blocks: list[Block] = (
            [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        )
        last["content"] = blocks + self._take_notes()

    async def _call(self, call: ToolCall) -> Block:
        """Run one tool call; its result (or what was wrong with it) as a tool_result.

        Events keep the call cut down: the name at NAME_SHOWN characters, the input by
        ``capped`` (strings at EVENT_TEXT characters, with a note), the result as a
        500-character preview; ``sent_id`` is the id as sent when it was replaced.
        """
        ctx = self.ctx
        sent = call.sent
        name = sent.get("name", MISSING)
        raw = sent.get("input", MISSING)
        shown = shown_name(name)
        ctx.usage.tool_uses += 1
        event: dict[str, Any] = {
            "id": call.id,
            "tool": shown,
            "input": None if raw is MISSING else capped(raw),
        }
        if sent.get("id") != call.id:
            event["sent_id"] = capped(sent.get("id"), text=NAME_SHOWN, chars=NAME_SHOWN, nodes=10)
        ctx.store.add_event(ctx.run_id, "tool_call", event)
        ctx.store.note_activity(
            ctx.run_id,
            shown,
            summarize_input(shown, None if raw is MISSING else raw),
            usage=ctx.usage.model_copy(),
        )
        ctx.inflight += 1
        try:
            output = await self._execute(name, raw)
        finally:
            ctx.inflight -= 1
        self.on_progress()
        # a name a sandbox made (undecodable bytes) arrives with lone surrogates: cleaned,
        # as the model's own strings are, before the store or the next request sees it
        output.content = clean_text(cut(output.content, ctx.settings.tool_output_limit))
        ctx.store.add_event(
            ctx.run_id,
            "tool_result",
            {
                "id": call.id,
                "tool": shown,
                "is_error": output.is_error,
                "chars": len(output.content),
                "preview": output.content[:500],
            },
        )
        block: Block = {"type": "tool_result", "tool_use_id": call.id, "content": output.content}
        if output.is_error:
            block["is_error"] = True
        return block

    async def _execute(self, name: object, raw: object) -> ToolOutput:
        """One call as sent (``name`` and ``raw`` input may be anything, or MISSING)."""
        ctx = self.ctx
        tool = ctx.tools.get(name) if isinstance(name, str) else None
        if tool is None or not isinstance(name, str):
            if isinstance(name, str):
                problem = f"unknown tool {shown_name(name)!r}"
            elif name is MISSING:
                problem = "invalid tool call: the tool_use block has no name"
            else:
                problem = f"invalid tool call: the tool name is {json_kind(name)}, not a string"
            offered = ", ".join(sorted(ctx.policy.offered_tools()))
            return ToolOutput(f"{problem}; your tools: {offered}", True)
        if not isinstance(raw, dict):
            if raw is MISSING:
                why = "the tool_use block has no input; send a JSON object"
            else:
                got = json.dumps(capped(raw, text=60, chars=60, nodes=10))[:100]
                why = f"the input must be a JSON object, not {json_kind(raw)} ({got})"
            return ToolOutput(f"invalid input for {name}: {why}", True)
        args: dict[str, Any] = raw
        # Command checks are CPU work on untrusted text: a long command is checked off the
        # event loop (for a short one the thread hop costs more than the check).
        command = args.get("command")
        if isinstance(command, str) and len(command) > OFF_LOOP_CHECK_CHARS:
            decision = await asyncio.to_thread(ctx.policy.check_call, name, args)
        else:
            decision = ctx.policy.check_call(name, args)
        if not decision.allowed:
            ctx.store.add_event(
                ctx.run_id, "tool_refused", {"tool": name, "reason": decision.reason}
            )
            return ToolOutput(decision.reason, is_error=True)
        try:
            parsed = tool.input_model.model_validate(args)
        except ValidationError as e:
            errors = e.errors(include_url=False)
            problems = "; ".join(
                f"{'.'.join(shown_name(str(p)) for p in err['loc']) or 'input'}: {err['msg']}"
                for err in errors[:MAX_PROBLEMS]
            )
            if len(errors) > MAX_PROBLEMS:
                problems += f"; and {len(errors) - MAX_PROBLEMS:,} more"
            return ToolOutput(f"invalid input for {name}: {problems}", is_error=True)
        payload = {"tool_name": name, "tool_input": args, **self._hook_base()}
        pre = await run_hooks(
            ctx.settings.hooks.pre_tool_use,
            "PreToolUse",
            name,
            payload,
            cwd=ctx.hook_cwd,
            env=ctx.env,
        )
        if pre.blocked:
            ctx.store.add_event(ctx.run_id, "tool_refused", {"tool": name, "reason": pre.message})
            return ToolOutput(f"blocked by PreToolUse hook: {pre.message}", is_error=True)
        limit = tool.time_limit(parsed, ctx.settings)
        try:
            async with asyncio.timeout(limit):
                output = await tool.run(ctx.tool_ctx, parsed)
        except TimeoutError:
            output = ToolOutput(f"{name} did not finish within {limit:g}s; cancelled", True)
        except ToolFailure as e:
            output = ToolOutput(str(e), is_error=True)
        except Exception as e:  # a tool bug is the model's tool error, not the run's end
            output = ToolOutput(f"{name} failed: {type(e).__name__}: {e}", is_error=True)
        if ctx.settings.hooks.post_tool_use:
            post = await run_hooks(
                ctx.settings.hooks.post_tool_use,
                "PostToolUse",
                name,
                {**payload, "tool_response": output.content[:10_000]},
                cwd=ctx.hook_cwd,
                env=ctx.env,
            )
            if post.blocked:
                output = ToolOutput(
                    output.content + f"\n[PostToolUse hook: {post.message}]", is_error=True
                )
        return output

    def _hook_base(self) -> dict[str, Any]:
        r = self.ctx.record
        return {
            "run_id": r.run_id,
            "chain_id": r.chain_id,
            "depth": r.depth,
            "agent": r.agent,
            "cwd": str(self.ctx.hook_cwd),
        }
