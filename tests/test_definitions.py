"""Agent and skill definitions: the real-world corpus, tool mapping, precedence, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest
from typer.testing import CliRunner

from orchestrator.catalog.definitions import (
    AgentDefinition,
    Catalog,
    DefinitionError,
    SkillDefinition,
    UnknownAgent,
    UnknownSkill,
    bundled_dir,
    load_agent_file,
    load_catalog,
    load_skill_file,
    parse_agent,
    parse_skill,
    validate_files,
)
from orchestrator.cli.catalog import agents_app, skills_app
from orchestrator.errors import UsageError
from orchestrator.tools.skills import LoadSkillInput, LoadSkillTool

# Third-party agent files and skills, vendored unchanged with their licences
# (see tests/fixtures/corpus/README.md).
CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
ALL_TOOLS = ["read_file", "write_file", "edit_file", "bash", "glob", "grep", "load_skill", "task"]


@pytest.fixture(scope="module")
def corpus() -> Path:
    if not (CORPUS / "claude-agents").is_dir() or not (CORPUS / "skills").is_dir():
        pytest.fail(
            f"the compatibility corpus is missing: expected {CORPUS}/claude-agents and "
            f"{CORPUS}/skills (vendored test fixtures; restore them from version control)"
        )
    return CORPUS


def agent(frontmatter: str, body: str = "You are a test agent.", path: str = "a.md") -> Any:
    return parse_agent(f"---\n{frontmatter.strip()}\n---\n\n{body}\n", path)


def write_agent(directory: Path, name: str, description: str, extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.md"
    path.write_text(f"---\nname: {name}\ndescription: {description}\n{extra}---\n\nPrompt.\n")
    return path


def write_skill(directory: Path, name: str, description: str, body: str) -> Path:
    (directory / name).mkdir(parents=True, exist_ok=True)
    path = directory / name / "SKILL.md"
    path.write_text(f"---\nname: {name}\ndescription: {description}\n---\n\n{body}\n")
    return path


# --- the corpus ----------------------------------------------------------------------


def test_every_corpus_agent_loads(corpus: Path, tmp_path: Path) -> None:
    agents_dir = corpus / "claude-agents"
    expected = [p for p in agents_dir.glob("*.md") if not p.name.startswith("LICENSE")]
    catalog = load_catalog(None, [agents_dir], home=tmp_path)
    warnings = sum(
        len(catalog.agents[p.stem].warnings) for p in expected if p.stem in catalog.agents
    )
    print(f"corpus: {len(expected)} agent files, {len(catalog.agents)} loaded, {warnings} warnings")
    assert [str(e) for e in catalog.errors] == []
    assert len(expected) == 158
    assert {p.stem for p in expected} <= set(catalog.agents)  # the file names are the names
    for p in expected:
        a = catalog.agents[p.stem]
        assert a.source == str(p)
        assert a.description and a.system_prompt
        assert a.tools is not None and "read_file" in a.tools
        assert all(t in ALL_TOOLS or t.startswith("mcp__") for t in a.tools), (p.name, a.tools)
    # `license-engineer.md` is an agent, not a licence file.
    assert "license-engineer" in catalog.agents


def test_corpus_descriptions_with_unquoted_colons_load_as_text(corpus: Path) -> None:
    a = load_agent_file(corpus / "claude-agents" / "ab-test-analysis.md")
    assert "Triggers on: 'analyze A/B test'" in a.description
    assert a.description.endswith("'did it work'.")
    assert any("line 3" in w and "'description'" in w for w in a.warnings)
    assert a.tools == ["read_file", "grep", "glob"]


def test_corpus_agent_fields_are_mapped(corpus: Path) -> None:
    a = load_agent_file(corpus / "claude-agents" / "scientific-literature-researcher.md")
    assert a.tools == ["read_file", "mcp__bgpt__search_papers"]  # an MCP tool, as written
    joined = "\n".join(a.warnings)
    for dropped in ("WebFetch", "WebSearch"):
        assert f"tool '{dropped}' cannot be honoured by orch" in joined
    whole = load_agent_file(corpus / "claude-agents" / "visual-asset-generator.md")
    assert whole.tools is not None and "mcp__prompt-to-asset" in whole.tools  # a whole server
    models = {p.stem: load_agent_file(p).model for p in (corpus / "claude-agents").glob("*.md")}
    assert None in models.values() and "sonnet" in models.values() and "haiku" in models.values()
    assert "inherit" not in models.values()


def test_every_corpus_skill_loads(corpus: Path, tmp_path: Path) -> None:
    files = sorted((corpus / "skills").glob("*/SKILL.md"))
    assert len(files) == 12
    for path in files:
        skill = load_skill_file(path)
        assert skill.name == path.parent.name
        assert skill.description and skill.body
        assert not skill.body.startswith("---")
        assert skill.warnings == [], (path, skill.warnings)
    catalog = load_catalog(None, home=tmp_path, skills_dirs=[corpus / "skills"])
    assert catalog.errors == []
    assert {p.parent.name for p in files} <= set(catalog.skills)
    print(f"corpus: {len(files)} skills loaded")


# --- tool names ----------------------------------------------------------------------

CLAUDE_TOOLS = "Read, Write, Edit, MultiEdit, Bash, Glob, Grep, LS, Task, Agent, NotebookRead"
MAPPED = ["read_file", "write_file", "edit_file", "bash", "glob", "grep", "task"]


def test_tool_names_map_from_a_comma_string() -> None:
    a = agent(f"name: a\ndescription: d\ntools: {CLAUDE_TOOLS}")
    assert a.tools == MAPPED
    assert a.warnings == []


def test_tool_names_map_from_a_yaml_list() -> None:
    items = "\n".join(f"  - {t.strip()}" for t in CLAUDE_TOOLS.split(","))
    a = agent(f"name: a\ndescription: d\ntools:\n{items}")
    assert a.tools == MAPPED
    flow = agent("name: a\ndescription: d\ntools: [Read, Agent, Grep]")
    assert flow.tools == ["read_file", "task", "grep"]


def test_unsupported_tools_warn_and_are_dropped() -> None:
    a = agent(
        "name: a\ndescription: d\ntools: Read, WebFetch, WebSearch, mcp__x__y, TodoWrite, Zap, "
        "mcp__a__b__c, mcp__, mcp__*"
    )
    assert a.tools == ["read_file", "mcp__x__y", "mcp__a__b__c"]  # a tool's name may hold "__"
    assert len(a.warnings) == 6
    for name in ("WebFetch", "WebSearch", "TodoWrite", "Zap", "mcp__", "mcp__*"):
        assert any(
            f"tool '{name}' cannot be honoured by orch" in w and "loads without it" in w
            for w in a.warnings
        ), name


def test_our_own_tool_names_pass_through() -> None:
    a = agent(
        "name: a\ndescription: d\ntools: [read_file, bash, load_skill, task_output, task_stop]"
    )
    assert a.tools == ["read_file", "bash", "load_skill", "task_output", "task_stop"]
    assert a.warnings == []


def test_permission_patterns_map_by_tool_name_with_a_warning() -> None:
    a = agent('name: a\ndescription: d\ntools: Read, "Bash(git:*)", Bash(npm test)')
    assert a.tools == ["read_file", "bash"]
    assert sum("is not enforced" in w for w in a.warnings) == 2


def test_disallowed_tools_and_allowed_tools() -> None:
    a = agent("name: a\ndescription: d\ndisallowedTools: Write, Edit, WebFetch")
    assert a.tools is None
    assert a.disallowed_tools == ["write_file", "edit_file"]
    assert a.warnings == []  # denying a tool orch lacks anyway is harmless
    assert a.allowed_tools(ALL_TOOLS) == [
        "read_file",
        "bash",
        "glob",
        "grep",
        "load_skill",
        "task",
        "mcp__*",  # no tools list: every MCP tool its parent has (none named: no server)
    ]
    b = agent("name: b\ndescription: d\ntools: Grep, Read, Bash\ndisallowedTools: [Bash]")
    assert b.allowed_tools(ALL_TOOLS) == ["read_file", "grep"]  # in the registry's order
    none = agent("name: c\ndescription: d\ntools: []")
    assert none.tools == [] and none.allowed_tools(ALL_TOOLS) == []


def test_no_tools_key_means_every_tool_and_inherit_means_no_model() -> None:
    a = agent("name: a\ndescription: d\nmodel: inherit")
    assert a.tools is None and a.model is None
    assert a.allowed_tools(ALL_TOOLS) == [*ALL_TOOLS, "mcp__*"]
    assert agent("name: a\ndescription: d\nmodel: opus").model == "opus"
    assert agent("name: a\ndescription: d\nmodel: claude-x-1").model == "claude-x-1"


def test_all_claude_code_fields_are_read() -> None:
    a = agent(
        "name: a\ndescription: d\npermissionMode: plan\nmaxTurns: 7\nskills: git-hygiene, x\n"
        "isolation: container\nbackground: true\ncolor: green"
    )
    assert (a.permission_mode, a.max_turns, a.skills) == ("plan", 7, ["git-hygiene", "x"])
    assert (a.isolation, a.background, a.color) == ("container", True, "green")
    assert a.warnings == []
    snake = agent("name: a\ndescription: d\nmax_turns: 3\ndisallowed-tools: Bash")
    assert snake.max_turns == 3 and snake.disallowed_tools == ["bash"]


def test_unknown_frontmatter_fields_warn() -> None:
    a = agent("name: a\ndescription: d\nhooks: {}\nmemory: project\nfoo: 1")
    for key in ("hooks", "memory", "foo"):
        assert f"field '{key}' is not supported yet; ignored" in a.warnings


def test_file_name_differing_from_name_uses_name(tmp_path: Path) -> None:
    path = write_agent(tmp_path / "agents", "real-name", "d")
    path.rename(tmp_path / "agents" / "other.md")
    catalog = load_catalog(None, [tmp_path / "agents"], home=tmp_path)
    assert "real-name" in catalog.agents and "other" not in catalog.agents
    assert any("differs from name" in w for w in catalog.agents["real-name"].warnings)


# --- errors --------------------------------------------------------------------------


def test_bad_yaml_error_names_the_file_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.md"
    path.write_text("---\nname: bad\ndescription: d\ntools: [Read, Write\n---\nbody\n")
    with pytest.raises(DefinitionError) as info:
        load_agent_file(path)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}:4: frontmatter is not valid YAML")
    nested = tmp_path / "nested.md"
    nested.write_text("\n---\nname: n\ndescription: d\nhooks:\n  a: b: c\n---\nbody\n")
    with pytest.raises(DefinitionError) as info2:
        load_agent_file(nested)
    assert info2.value.line == 6
    with pytest.raises(DefinitionError, match=r"^q\.md:3: frontmatter is not valid YAML"):
        parse_agent("---\nname: q\ndescription: 'unclosed\ntools: Read\n---\n", "q.md")


def test_missing_description_error(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError) as info:
        parse_agent("---\nname: x\ntools: Read\n---\nbody\n", tmp_path / "x.md")
    assert "missing 'description'" in str(info.value)
    assert str(info.value).startswith(f"{tmp_path / 'x.md'}:")
    with pytest.raises(DefinitionError, match="missing 'name'"):
        parse_agent("---\ndescription: d\n---\nbody\n", "y.md")


def test_no_frontmatter_and_wrong_types_are_errors() -> None:
    with pytest.raises(DefinitionError, match=r"^z\.md:1: no YAML frontmatter"):
        parse_agent("# Just markdown\n", "z.md")
    with pytest.raises(DefinitionError, match="never closed"):
        parse_agent("---\nname: a\ndescription: d\n", "z.md")
    cases = {
        "maxTurns: ten": "'maxTurns' must be a whole number",
        "isolation: vm": "'isolation' must be one of shared, worktree, container",
        "background: maybe": "'background' must be true or false",
        "tools: 5": "'tools' must be a comma-separated string or a list",
        "model: [a, b]": "'model' must be a string",
    }
    for line, message in cases.items():
        with pytest.raises(DefinitionError, match=message) as info:
            agent(f"name: a\ndescription: d\n{line}")
        assert info.value.line == 4, line
    with pytest.raises(DefinitionError, match="must be 'key: value' lines"):
        parse_agent("---\n- a\n- b\n---\n", "z.md")


def test_broken_files_are_reported_not_raised(tmp_path: Path) -> None:
    d = tmp_path / "agents"
    write_agent(d, "good", "fine")
    (d / "broken.md").write_text("no frontmatter here\n")
    (d / "README.md").write_text("not an agent\n")
    (d / "LICENSE.md").write_text("not an agent either\n")
    catalog = load_catalog(None, [d], home=tmp_path)
    assert "good" in catalog.agents
    assert [e.path for e in catalog.errors] == [str(d / "broken.md")]


def test_unknown_agent_error_lists_names(tmp_path: Path) -> None:
    catalog = load_catalog(None, [], home=tmp_path)
    with pytest.raises(UnknownAgent) as info:
        catalog.agent("nope")
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2
    for name in ("general", "explorer", "writer", "reviewer"):
        assert name in str(info.value)


def test_missing_agents_dir_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_catalog(None, [tmp_path / "missing"], home=tmp_path)


# --- precedence ----------------------------------------------------------------------


def test_agent_precedence(tmp_path: Path) -> None:
    project, home, flag = tmp_path / "proj", tmp_path / "home", tmp_path / "flag"
    levels = [
        flag,
        project / ".orch" / "agents",
        project / ".claude" / "agents",
        home / ".orch" / "agents",
    ]
    for level in levels:
        write_agent(level, "dup", f"from {level}")
        write_agent(level, "general", f"general from {level}")
    write_agent(project / ".claude" / "agents", "only-claude", "c")

    for i, level in enumerate(levels):
        catalog = load_catalog(project, [flag] if flag in levels[i:] else [], home=home)
        assert catalog.agents["dup"].description == f"from {level}"
        assert catalog.agents["general"].source == str(level / "general.md")  # beats bundled
        assert "only-claude" in catalog.agents and "explorer" in catalog.agents
        assert catalog.errors == []
        (level / "dup.md").unlink()
        (level / "general.md").unlink()
    catalog = load_catalog(project, [], home=home)
    assert catalog.agents["general"].source == "bundled:general"


def test_skill_precedence(tmp_path: Path) -> None:
    project, home = tmp_path / "proj", tmp_path / "home"
    write_skill(home / ".orch" / "skills", "git-hygiene", "home version", "home body")
    write_skill(project / ".claude" / "skills", "git-hygiene", "claude version", "claude body")
    write_skill(project / ".orch" / "skills", "extra", "extra skill", "extra body")
    catalog = load_catalog(project, [], home=home)
    # a repository's skill never takes the name of the user's untrusted (test_sec38_shadowing)
    assert catalog.skill("git-hygiene").description == "home version"
    assert catalog.skill("extra").body == "extra body"
    assert catalog.skill("delegation-prompts").source == "bundled:delegation-prompts"


# --- skills --------------------------------------------------------------------------


def test_skill_catalog_text_holds_names_and_descriptions_only() -> None:
    catalog = Catalog(
        skills={
            "one": SkillDefinition(
                name="one", description="First\n  skill.", body="SECRET BODY 1", source="x"
            ),
            "two": SkillDefinition(name="two", description="Second.", body="BODY 2", source="y"),
        }
    )
    text = catalog.skill_catalog_text()
    assert text == "- one: First skill.\n- two: Second."
    assert "BODY" not in text
    assert catalog.skill_catalog_text(["two"]) == "- two: Second."
    assert catalog.skill("one").body == "SECRET BODY 1"
    with pytest.raises(UnknownSkill, match="available skills: one, two"):
        catalog.skill("three")


def test_skill_frontmatter_defaults() -> None:
    s = parse_skill(
        "---\nlicense: MIT\nallowed-tools: Read\n---\n# Title line\n\nText.\n", "d/x/SKILL.md"
    )
    assert s.name == "x"
    assert s.description == "Title line"
    assert s.warnings == ["no 'description'; using the body's first line (add a description)"]
    odd = parse_skill("---\nname: y\ndescription: d\nweird: 1\n---\nbody", "d/y/SKILL.md")
    assert odd.warnings == ["field 'weird' is not supported yet; ignored"]
    with pytest.raises(DefinitionError, match="missing 'description'"):
        parse_skill("---\nname: z\n---\n", "d/z/SKILL.md")


def test_load_skill_tool(tmp_path: Path) -> None:
    catalog = load_catalog(None, [], home=tmp_path)
    ctx = cast(Any, type("Ctx", (), {"skills": catalog.skills})())
    tool = LoadSkillTool()
    assert tool.name == "load_skill" and not tool.writes
    assert tool.schema()["input_schema"]["required"] == ["name"]
    ok = asyncio.run(tool.run(ctx, LoadSkillInput(name="git-hygiene")))
    assert not ok.is_error and ok.content == catalog.skill("git-hygiene").body
    bad = asyncio.run(tool.run(ctx, LoadSkillInput(name="nope")))
    assert bad.is_error and "code-review-checklist" in bad.content and "nope" in bad.content


# --- bundled -------------------------------------------------------------------------


def test_bundled_agents_and_skills_load(tmp_path: Path) -> None:
    assert bundled_dir("agents") is not None and bundled_dir("skills") is not None
    catalog = load_catalog(None, [], home=tmp_path)
    assert catalog.errors == []
    bundled = {n: a for n, a in catalog.agents.items() if a.source.startswith("bundled:")}
    assert set(bundled) == {"general", "explorer", "writer", "reviewer"}
    for a in bundled.values():
        assert a.warnings == [] and len(a.system_prompt) > 500
    assert bundled["general"].tools is None
    assert bundled["explorer"].tools == ["read_file", "glob", "grep"]
    assert bundled["reviewer"].tools == ["read_file", "glob", "grep"]
    assert "changes_requested" in bundled["reviewer"].system_prompt
    writer: AgentDefinition = bundled["writer"]
    assert writer.isolation == "worktree"
    assert set(writer.tools or []) == {
        "read_file",
        "write_file",
        "edit_file",
        "glob",
        "grep",
        "bash",
    }
    skills = {n: s for n, s in catalog.skills.items() if s.source.startswith("bundled:")}
    assert set(skills) == {"code-review-checklist", "delegation-prompts", "git-hygiene"}
    for s in skills.values():
        assert s.warnings == [] and 30 <= len(s.body.splitlines()) <= 90


# --- validate and the CLI ------------------------------------------------------------


def test_validate_files(corpus: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.md"
    bad.write_text("---\nname: bad\n---\n")
    reports = validate_files(
        [
            corpus / "claude-agents" / "ab-test-analysis.md",
            bad,
            corpus / "skills" / "mcp-builder" / "SKILL.md",
        ]
    )
    assert [(r.kind, r.ok, r.name) for r in reports] == [
        ("agent", True, "ab-test-analysis"),
        ("agent", False, None),
        ("skill", True, "mcp-builder"),
    ]
    assert reports[0].warnings and reports[1].error and reports[1].error.startswith(f"{bad}:")


def test_cli_validate_and_show(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no project definitions but the bundled ones
    runner = CliRunner()
    good = runner.invoke(
        agents_app, ["validate", str(corpus / "claude-agents" / "ab-test-analysis.md")]
    )
    assert good.exit_code == 0, good.output
    assert "ok" in good.output and "warning:" in good.output
    bad = tmp_path / "bad.md"
    bad.write_text("---\nname: bad\ntools: [Read\n---\n")
    failed = runner.invoke(agents_app, ["validate", "--json", str(bad)])
    assert failed.exit_code == 1
    assert json.loads(failed.stdout)[0]["error"].startswith(f"{bad}:3:")
    missing = runner.invoke(agents_app, ["show", "no-such-agent"])
    assert missing.exit_code == 2 and "available agents" in missing.output
    shown = runner.invoke(agents_app, ["show", "explorer", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["tools"] == [
        "read_file",
        "glob",
        "grep",
    ]
    listed = runner.invoke(
        agents_app, ["list", "--json", "--agents-dir", str(corpus / "claude-agents")]
    )
    assert listed.exit_code == 0
    assert len(json.loads(listed.stdout)["agents"]) == 158 + 4
    skills = runner.invoke(skills_app, ["list", "--json"])
    assert skills.exit_code == 0 and "git-hygiene" in skills.stdout
