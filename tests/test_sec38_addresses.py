"""Address classes (issue 38, class 15): an IPv6 address that carries an IPv4 one
(IPv4-mapped ``::ffff:a.b.c.d``, IPv4-compatible ``::a.b.c.d``, IPv4-translated
``::ffff:0:a.b.c.d``) is classed by that IPv4 address in the egress rules: not public when
it is not, and named by an entry that names it.

The attack: an allow-list with a name the agent controls (or ``*``); the name resolves to
``::127.0.0.1``, which Python's ``is_global`` calls global, so the proxy took it for a
public address and let the connection through. End to end through the proxy with the
scripted model and the real bubblewrap (a test resolver gives the answers, as in
test_egress.py); the forms and wrappers one by one below.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from orchestrator.egress.proxy import Egress
from orchestrator.egress.rules import AllowList, Reach, Rule, carried, public
from orchestrator.run import RunStatus
from tests.support import harness, init_repo
from tests.test_egress import bash, egress_events, fetch, outputs

LOOPBACK_FORMS = ["::127.0.0.1", "::ffff:0:127.0.0.1", "::ffff:127.0.0.1"]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})


@pytest.mark.bwrap
def test_a_name_resolving_to_an_ipv6_form_of_loopback_is_refused(
    repo: Path, servers: tuple[int, int]
) -> None:
    """Each name is allowed; each resolves to the host's 127.0.0.1 written as IPv6. Every
    one is refused as not public, and a literal such address is not matched by ``*``."""
    allowed, _ = servers
    answers = {f"h{i}.test": [form] for i, form in enumerate(LOOPBACK_FORMS)}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    calls = [bash(fetch(f"http://{name}:{allowed}/x")) for name in answers]
    calls.append(bash(fetch(f"http://[::127.0.0.1]:{allowed}/y")))
    script = {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    names = [f"{name}:{allowed}" for name in answers] + [f"*:{allowed}"]
    h = harness(repo, script, network={"allow": names})
    h.runner.egress = Egress(resolve=resolve)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    said = outputs(h, root.run_id)
    for text, form in zip(said, LOOPBACK_FORMS, strict=False):
        assert "HTTP 403" in text and "not a public address" in text, (form, text)
        assert "BODY" not in text
    assert "HTTP 403" in said[-1] and "not in the run's network allow-list" in said[-1]
    assert not any(e.get("allowed") for e in egress_events(h, root.run_id))


@pytest.mark.bwrap
def test_listing_the_ipv4_address_lets_its_mapped_form_through(
    repo: Path, servers: tuple[int, int]
) -> None:
    """The same class the other way: a list that names 127.0.0.1 names ``::ffff:127.0.0.1``
    (a dual-stack socket reaches the host's 127.0.0.1 through it; the test suite's own
    guard then stops the proxy's connection, so the proof is that the rules let it by)."""
    allowed, _ = servers

    async def resolve(host: str, port: int) -> list[str]:
        return ["::ffff:127.0.0.1"]

    calls = [bash(fetch(f"http://mapped.test:{allowed}/m"))]
    script = {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    h = harness(repo, script, network={"allow": [f"mapped.test:{allowed}", f"127.0.0.1:{allowed}"]})
    h.runner.egress = Egress(resolve=resolve)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    said = outputs(h, root.run_id)[0]
    assert "HTTP 403" not in said, said
    assert f"BODY hello from {allowed} /m" in said or "cannot connect to ::ffff:7f00:1" in said


@pytest.mark.parametrize(
    ("address", "inner"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("::127.0.0.1", "127.0.0.1"),
        ("::ffff:0:10.0.0.1", "10.0.0.1"),
        ("::ffff:0:7f00:1", "127.0.0.1"),
        ("::192.168.1.1", "192.168.1.1"),
        ("::169.254.169.254", "169.254.169.254"),  # the cloud's metadata service
        ("::8.8.8.8", "8.8.8.8"),
        ("::1", None),  # IPv6's own loopback, not 0.0.0.1
        ("::", None),
        ("2606:4700::1111", None),
    ],
)
def test_an_ipv6_address_is_classed_by_the_ipv4_address_it_carries(
    address: str, inner: str | None
) -> None:
    a = ipaddress.ip_address(address)
    assert carried(a) == (ipaddress.ip_address(inner) if inner else None)
    if inner is not None:
        assert public(a) == public(ipaddress.ip_address(inner))


@pytest.mark.parametrize(
    "address",
    [
        "::127.0.0.1",
        "::ffff:0:127.0.0.1",
        "::ffff:127.0.0.1",
        "::10.1.2.3",
        "::ffff:0:192.168.0.1",
        "::169.254.169.254",
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2002:a00:1::1",  # 6to4 of 10.0.0.1
        "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo of 127.0.0.1
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    ],
)
def test_no_wrapped_private_address_passes_as_public(address: str) -> None:
    a = ipaddress.ip_address(address)
    assert not public(a)
    star = Reach.of(AllowList(allow=("*:*",)))
    assert star.check_name(str(a), 80) != ""  # `*` matches public addresses only
    assert "not a public address" in star.check_address("x.test", 80, a)


def test_an_entry_names_the_ipv6_forms_of_its_ipv4_addresses_and_no_other() -> None:
    rule = Rule.parse("127.0.0.1:8080")
    for form in LOOPBACK_FORMS:
        assert rule.lists(ipaddress.ip_address(form), 8080)
        assert rule.matches(form, 8080)
        assert not rule.lists(ipaddress.ip_address(form), 8081)
    assert not rule.lists(ipaddress.ip_address("::1"), 8080)
    assert not Rule.parse("[::1]:8080").lists(ipaddress.ip_address("::127.0.0.1"), 8080)
    assert not Rule.parse("10.0.0.0/8").lists(ipaddress.ip_address("::ffff:11.0.0.1"), 443)
