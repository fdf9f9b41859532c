"""A chain's budgets of tokens and dollars, spent while its runs work.

``max_chain_tokens`` and ``max_chain_usd`` (set by the chain's root, kept by every run of
it: ``RunPlan.budgets``) are checked when a run is stored (the store's ``ChainRoom``,
:mod:`orchestrator.engine.admission`). A chain with a dollar budget is also checked before
every model request of a running run (:func:`exhausted`, both budgets), so it stops at its
next request, whichever of its runs makes it. The token budget alone (10M by default: a
ceiling for a runaway) is not read before every request: that read costs every request of
every chain a store round trip. The sum is the store's: every run of the chain,
in any process, writes its usage there after each response, so the check holds with many
runs spending at once (each may still finish the one request it has sent).
"""

from __future__ import annotations

from ..models.pricing import money
from ..run import RunRecord, Usage
from ..spec import Budgets
from ..store import ChainUsage, RunStore


def more(setting: str) -> str:
    """How a user gets more of a budget (a repository may lower a limit, never raise it
    untrusted)."""
    return (
        f"more needs a higher {setting} in ~/.orch/config.toml, or in orch.toml and then "
        "`orch trust`"
    )


def used_up(used: ChainUsage, tokens: int | None, usd: float | None) -> tuple[str, str] | None:
    """(the setting, what the chain used of it) when ``used`` reaches the chain's budget of
    ``tokens`` or of ``usd`` (None: no such budget), else None."""
    if tokens is not None and used.tokens >= tokens:
        return "max_chain_tokens", (
            f"chain budget max_chain_tokens ({tokens:,}) is used up: this chain has used "
            f"{used.tokens:,} tokens"
        )
    if usd is not None and used.usd >= usd:
        return "max_chain_usd", (
            f"chain budget max_chain_usd ({money(usd)}) is used up: this chain has spent "
            f"{money(used.usd)}"
        )
    return None


# each run's last sum of its chain read from the store, and its own usage then: while the
# store is away, the chain has used at least that plus what the run spent since
_KNOWN: dict[str, tuple[ChainUsage, Usage]] = {}


def exhausted(store: RunStore, record: RunRecord, spent: Usage | None = None) -> str | None:
    """The one-line reason ``record`` must not make another model request: its chain has
    used up its token or dollar budget (the store's sum over every run of the chain). None
    when the chain has room, or no dollar budget (then the store is not read).

    While the store is away (``transient``), the run goes on under what this process
    knows, never more: the last sum read for it plus what it has ``spent`` since (its
    usage so far; without one read yet, that usage alone)."""
    budgets: Budgets | None = record.plan.budgets if record.plan else None
    if budgets is None or budgets.usd is None:
        return None
    own = (spent or record.usage).model_copy()
    try:
        used = store.chain_usage(
            record.chain_id, tokens=budgets.tokens is not None, usd=budgets.usd is not None
        )
        _KNOWN[record.run_id] = (used, own)
    except Exception as e:
        if not store.transient(e):
            raise
        used = known(record.run_id, own)
    found = used_up(used, budgets.tokens, budgets.usd)
    if found is None:
        return None
    setting, said = found
    return f"{said}; the run stopped before its next model request ({more(setting)})"


def known(run_id: str, own: Usage) -> ChainUsage:
    """What the chain of ``run_id`` has used at least, as this process knows it."""
    last, then = _KNOWN.get(run_id, (ChainUsage(runs=1, live=1, tokens=0), Usage()))
    return ChainUsage(
        runs=last.runs,
        live=last.live,
        tokens=last.tokens + max(0, own.tokens - then.tokens),
        usd=last.usd + max(0.0, own.cost_usd - then.cost_usd),
    )


def forget(run_id: str) -> None:
    """The run ended: its last read is not needed."""
    _KNOWN.pop(run_id, None)
