"""``max_chain_usd``: a chain-wide dollar budget, like ``max_chain_tokens``.

Set by the chain's root and kept by every run of it; the store sums the dollars of the
chain's runs (SQLite: the records' JSON; Postgres: ``runs.cost_usd``, added to an older
database by its migration); a child past it is refused and a running run stops at its next
model request (``engine/budget.py::exhausted``), each with one line naming the setting and
what was spent. An untrusted repository may lower it, never raise it. End to end through
the real ``anthropic`` SDK against the fake Messages API on loopback.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings, load_settings, load_settings_with_trust
from orchestrator.engine.admission import Admission
from orchestrator.engine.budget import exhausted
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider, pricing
from orchestrator.models.base import ModelUsage
from orchestrator.models.pricing import money
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.spec import Budgets, Launch, RunPlan, RunSpec
from orchestrator.store import ChainFull, ChainRoom, ChainUsage, RunStore, SqliteStore
from tests.fakeapi import FakeAPI, serve, system_text, text_reply, tool_reply
from tests.support import init_repo, orch

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
REASON = re.compile(
    r"^chain budget max_chain_usd \(\$0\.05\) is used up: this chain has spent "
    r"\$0\.(\d{2,4}); [^\n]*more needs a higher max_chain_usd in ~/\.orch/config\.toml, "
    r"or in orch\.toml and then `orch trust`\)$"
)


def _open(where: str) -> RunStore:
    if where.startswith("postgresql://"):
        from orchestrator.store.postgres import PostgresStore

        return PostgresStore(where)
    return SqliteStore(Path(where))


@pytest.fixture(params=BACKENDS)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a fresh store of each backend is: a SQLite file, or a database of its own."""
    if request.param == "sqlite":
        return str(tmp_path / "orch.db")
    url: str = request.getfixturevalue("pg_url")
    return url


def _planned(run_id: str, chain: str, budgets: Budgets | None, **usage: Any) -> RunRecord:
    spec = RunSpec(prompt="x", workdir=Path("/tmp"))
    return RunRecord(
        run_id=run_id,
        chain_id=chain,
        plan=RunPlan(spec=spec, max_turns=5, budgets=budgets),
        usage=Usage(**usage),
    )


# -- (a) budgets, room, refusal ---------------------------------------------------------


def _rules(tmp_path: Path, settings: Settings) -> Admission:
    store = SqliteStore(tmp_path / f"orch-{id(settings)}.db")
    models = ModelProvider(settings)
    return Runner(
        settings=settings, store=store, catalog=load_catalog(tmp_path), models=models
    ).rules


def test_the_root_sets_the_dollar_budget_and_every_run_keeps_it(tmp_path: Path) -> None:
    rules = _rules(tmp_path, Settings(max_chain_usd=0.05))
    root, _ = rules.admit(RunSpec(prompt="go", workdir=tmp_path), None, None, launch=Launch())
    budgets = root.planned().budgets
    assert budgets is not None and budgets.usd == 0.05 and budgets.tokens == 10_000_000
    assert rules.room(root) is None  # a new root: nothing to check
    # a child admitted where the settings say otherwise keeps its chain's budget
    other = _rules(tmp_path, Settings(max_chain_usd=9.0))
    child, _ = other.admit(RunSpec(prompt="sub", workdir=tmp_path), None, root, launch=Launch())
    assert child.chain_id == root.chain_id and child.planned().budgets == budgets
    assert other.room(child) == ChainRoom(runs=500, tokens=10_000_000, usd=0.05)
    assert _rules(tmp_path, Settings()).budgets(None).usd is None  # no dollar budget


def test_a_refusal_names_the_setting_and_what_was_spent() -> None:
    room = ChainRoom(runs=10, tokens=1000, usd=0.05)
    usd = Admission.refusal(ChainFull(ChainUsage(3, 1, tokens=900, usd=0.0512), room))
    assert str(usd) == (
        "chain budget max_chain_usd ($0.05) is used up: this chain has spent $0.0512; finish "
        "with what you have (more needs a higher max_chain_usd in ~/.orch/config.toml, or in "
        "orch.toml and then `orch trust`)"
    )
    tokens = Admission.refusal(ChainFull(ChainUsage(3, 1, tokens=1200, usd=0.01), room))
    assert "max_chain_tokens (1,000) is used up: this chain has used 1,200 tokens" in str(tokens)
    runs = Admission.refusal(ChainFull(ChainUsage(10, 1, tokens=0, usd=0.9), room))
    assert "max_chain_runs (10) is used up" in str(runs)
    for said in (usd, tokens, runs):
        assert "\n" not in str(said)
    assert [money(x) for x in (0.05, 0.0512, 0.05123, 12.5, 1234.0, 0)] == [
        "$0.05", "$0.0512", "$0.0512", "$12.50", "$1,234.00", "$0"
    ]  # fmt: skip


# -- (a) the stores' sums ---------------------------------------------------------------


def test_the_store_sums_dollars_and_every_token(where: str) -> None:
    store = _open(where)
    try:
        store.create_run(_planned("r-1", "c", None, input_tokens=10, output_tokens=5,
                                  cache_creation_input_tokens=100, cache_read_input_tokens=1000,
                                  cost_usd=0.02))  # fmt: skip
        store.create_run(_planned("r-2", "c", None, input_tokens=1, cost_usd=0.025))
        store.create_run(_planned("r-3", "other", None, cost_usd=5.0))
        used = store.chain_usage("c", tokens=True, usd=True)
        assert (used.runs, used.tokens) == (2, 1116) and used.usd == pytest.approx(0.045)
        assert store.chain_usage("c").usd == 0 and store.chain_usage("c").tokens == 0
        assert store.chain_usage("none", tokens=True, usd=True) == ChainUsage(0, 0, 0, 0.0)
        # a run's usage written again counts as written
        store.update_run("r-2", usage=Usage(input_tokens=1, cost_usd=0.04))
        assert store.chain_usage("c", usd=True).usd == pytest.approx(0.06)
        # the room: a child is stored only while the chain has spent less than its budget
        room = ChainRoom(runs=10, usd=0.06)
        with pytest.raises(ChainFull) as full:
            store.create_run(_planned("r-4", "c", None), room=room)
        assert full.value.used.usd == pytest.approx(0.06) and full.value.room == room
        store.create_run(_planned("r-4", "c", None), room=ChainRoom(runs=10, usd=0.07))
        with pytest.raises(ChainFull):  # cache reads count against max_chain_tokens
            store.create_run(_planned("r-5", "c", None), room=ChainRoom(runs=10, tokens=1116))
    finally:
        store.close()


def test_an_older_sqlite_record_without_cache_or_dollars_counts_zero(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "orch.db")
    old = _planned("r-old", "c", None, input_tokens=7, output_tokens=3)
    data = json.loads(old.model_dump_json())
    for key in ("cache_creation_input_tokens", "cache_read_input_tokens", "cost_usd"):
        del data["usage"][key]
    store.create_run(old)
    store.dialect.write("UPDATE runs SET data = ? WHERE run_id = ?", (json.dumps(data), "r-old"))
    store.create_run(_planned("r-new", "c", None, cache_read_input_tokens=5, cost_usd=0.5))
    assert store.chain_usage("c", tokens=True, usd=True) == ChainUsage(2, 2, 15, 0.5)
    assert store.require_run("r-old").usage.cost_usd == 0


@pytest.mark.postgres
def test_an_older_postgres_database_is_migrated_when_opened(pg_url: str) -> None:
    """A database of an orch before runs.cost_usd (schema 1) opens: the column is added,
    its rows count $0 until written again, the version is 2; every process agrees."""
    import psycopg

    from orchestrator.store.postgres import SCHEMA_VERSION, PostgresStore
    from orchestrator.store.schema import Types, tables

    v1 = tables(
        Types(
            real="DOUBLE PRECISION",
            boolean="BOOLEAN",
            false="FALSE",
            serial="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
            key_collation=' COLLATE "C"',
            usage="\n    tokens BIGINT NOT NULL DEFAULT 0,",
        )
    )
    old = _planned("r-old", "c", None, input_tokens=7, cost_usd=0.3)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(v1 + "CREATE TABLE orch_schema (version INTEGER NOT NULL);")
        conn.execute("INSERT INTO orch_schema VALUES (1)")
        conn.execute(
            "INSERT INTO runs (run_id, chain_id, depth, status, created_at, updated_at,"
            " tokens, data) VALUES ('r-old', 'c', 0, 'queued', 1, 1, 7, %s)",
            (old.model_dump_json(),),
        )
    assert SCHEMA_VERSION == 2
    stores = [PostgresStore(pg_url) for _ in range(2)]
    try:
        store = stores[0]
        assert store.require_run("r-old").usage.cost_usd == 0.3
        assert store.chain_usage("c", tokens=True, usd=True) == ChainUsage(1, 1, 7, 0.0)
        store.update_run("r-old", usage=Usage(input_tokens=7, cost_usd=0.3))
        store.create_run(_planned("r-new", "c", None, cost_usd=0.2), room=ChainRoom(9, usd=1))
        assert stores[1].chain_usage("c", usd=True).usd == pytest.approx(0.5)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            row = conn.execute("SELECT version FROM orch_schema").fetchall()
        assert row == [(2,)]
    finally:
        for s in stores:
            s.close()


# -- (a) exhausted: a running chain stops at its next request ---------------------------


class _Unread:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was read ({name}) for a chain with no such budget")


def test_exhausted_reads_nothing_without_a_token_or_dollar_budget() -> None:
    store: Any = _Unread()
    assert exhausted(store, RunRecord(run_id="r", chain_id="c")) is None  # an older record
    bare = Budgets(running=2, runs=3)
    assert exhausted(store, _planned("r", "c", bare, cost_usd=99.0)) is None


def test_exhausted_holds_with_many_runs_spending_at_once(where: str) -> None:
    """Four runs of a chain, each on its own connection, spend $0.01 a request and ask
    before each: the chain stops once the store's sum reaches the budget, each run told in
    one line; at most one request each was in flight past it."""
    budgets = Budgets(running=4, runs=10, usd=0.2)
    first = _open(where)
    for i in range(4):
        first.create_run(_planned(f"r-{i}", "c", budgets))
    first.close()
    reasons: list[str] = []
    start = threading.Barrier(4)

    def run(i: int) -> None:
        mine = _open(where)
        record = mine.require_run(f"r-{i}")
        start.wait()
        try:
            while (why := exhausted(mine, record)) is None:
                record.usage.cost_usd += 0.01
                mine.update_run(record.run_id, usage=record.usage.model_copy())
            reasons.append(why)
        finally:
            mine.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store = _open(where)
    try:
        spent = store.chain_usage("c", usd=True).usd
    finally:
        store.close()
    assert len(reasons) == 4
    assert 0.2 - 1e-9 <= spent <= 0.2 + 4 * 0.01 + 1e-9
    for why in reasons:
        assert why.startswith("chain budget max_chain_usd ($0.20) is used up: this chain has ")
        assert "\n" not in why and "higher max_chain_usd" in why


def test_the_tree_shows_what_the_chain_spent() -> None:
    from orchestrator.cli.common import budget_line

    budgets = Budgets(running=2, runs=5, tokens=100, usd=0.05)
    runs = [_planned("r-1", "c", budgets, input_tokens=40, cache_read_input_tokens=9,
                     cost_usd=0.0312)]  # fmt: skip
    assert budget_line(runs).endswith("· tokens 49/100 · spent $0.0312/$0.05")


# -- (b) trust: a repository may lower it, never raise it untrusted ----------------------


def test_an_untrusted_repository_may_lower_max_chain_usd_but_not_raise_it(tmp_path: Path) -> None:
    home = Path.home() / ".orch"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text("max_chain_usd = 1.0\n")
    lower = init_repo(tmp_path / "lower", {"orch.toml": "max_chain_usd = 0.05\n"})
    settings, trust = load_settings_with_trust(lower)
    assert settings.max_chain_usd == 0.05 and trust.left_out == []
    higher = init_repo(tmp_path / "higher", {"orch.toml": "max_chain_usd = 50.0\n"})
    settings, trust = load_settings_with_trust(higher)
    assert settings.max_chain_usd == 1.0 and trust.left_out == ["max_chain_usd"]
    assert orch("trust", cwd=higher).returncode == 0  # trusted, as the refusal says: raised
    assert load_settings(higher).max_chain_usd == 50.0
    (home / "config.toml").write_text("")  # the user's none: a repository's is a lowering
    assert load_settings(lower).max_chain_usd == 0.05


# -- (c) end to end: the real SDK, the fake Messages API ---------------------------------

BIG = "".join(f"line {i:05d}: {'lorem ipsum dolor sit amet ' * 3}\n" for i in range(60))
READS = 10  # a reader's reads (each of another file) before it answers: ~$0.08 alone


def _depth(body: dict[str, Any]) -> int:
    m = re.search(r"at delegation depth (\d+)", system_text(body))
    assert m, "every request names its depth in the system prompt"
    return int(m.group(1))


def _spender(body: dict[str, Any]) -> dict[str, Any]:
    """The root delegates two readers at once, again and again; each reads ``READS`` big
    files (~1.5k tokens each: what each request costs grows) and answers."""
    turn = (len(body["messages"]) + 1) // 2
    if _depth(body) == 0:
        if turn > 6:
            return text_reply("root done")
        task = {"prompt": "Read the big files one by one."}
        return tool_reply(*[("task", {**task, "description": f"read {i}"}) for i in range(2)])
    if turn > READS:
        return text_reply("read enough")
    return tool_reply(("read_file", {"path": f"big-{turn}.txt"}))


def _costs(api: FakeAPI) -> list[float]:
    """What each request the fake API answered cost, by the usage it answered with."""
    kinds = ModelUsage.__dataclass_fields__
    return [
        pricing.cost("claude-sonnet-4-5", ModelUsage(**{k: u[k] for k in kinds if k in u}))
        for u in api.answered()
    ]


def test_a_chain_stops_at_its_dollar_budget(monkeypatch: pytest.MonkeyPatch, project: Path) -> None:
    for i in range(1, READS + 1):
        (project / f"big-{i}.txt").write_text(f"file {i}\n{BIG}")
    settings = Settings(max_chain_usd=0.05, model="claude-sonnet-4-5")
    with serve(FakeAPI(_spender)) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")
        store = SqliteStore.for_project(project)
        provider = ModelProvider(settings)
        runner = Runner(
            settings=settings, store=store, catalog=load_catalog(project), models=provider
        )

        async def main() -> RunRecord:
            async with provider:
                spec = RunSpec(prompt="Read everything.", workdir=project)
                return await asyncio.wait_for(runner.run(spec), 120)

        root = asyncio.run(main())
        costs = _costs(api)
    runs = store.list_runs(chain_id=root.chain_id)
    assert len(runs) == 3, "the root delegated two readers, then was stopped"
    # every run stopped at its next request once the chain had spent the budget: the
    # readers mid-way (none could finish within it), then the root
    assert all(r.status == RunStatus.FAILED for r in runs), [r.output for r in runs]
    for r in runs:
        assert r.error and REASON.match(r.error), r.error
        assert 0 < r.usage.turns <= READS
    spent = sum(r.usage.cost_usd for r in runs)
    said = float("0." + REASON.match(root.error or "").group(1))  # type: ignore[union-attr]
    assert said == pytest.approx(spent, abs=1e-4)  # the root stopped last: all was spent
    # past the budget by no more than the requests in flight when it was reached: one per
    # run working then (the two readers; the root waits for them)
    assert spent == pytest.approx(sum(costs))  # every request answered was priced
    assert 0.05 <= spent <= 0.05 + 2 * max(costs), (spent, costs)
    assert store.chain_usage(root.chain_id, usd=True).usd == pytest.approx(spent)
