"""The allow-list's rules (egress/rules.py) and the proxy on its own socket (egress/proxy.py):
what an entry names, what a list covers, how a child's list meets its parent's, which
resolved addresses pass, and the proxy's answers to requests a bridge would relay."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.catalog.definitions import DefinitionError, parse_agent
from orchestrator.config import Settings
from orchestrator.egress import proxy as proxymod
from orchestrator.egress.heads import Refused, parse_head, split_target
from orchestrator.egress.proxy import Door, EgressProxy
from orchestrator.egress.rules import AllowList, Reach, Rule, normal_name, public
from orchestrator.fs.private import private_dir


def reach(*entries: str) -> Reach:
    return Reach.of(AllowList(allow=entries))


@pytest.mark.parametrize(
    ("entry", "host", "port", "ok"),
    [
        ("pypi.org", "pypi.org", 443, True),
        ("pypi.org", "pypi.org", 80, True),
        ("pypi.org", "pypi.org", 8080, False),  # no port written: the web's two
        ("pypi.org", "evil-pypi.org", 443, False),
        ("pypi.org", "files.pypi.org", 443, False),
        ("*.githubusercontent.com", "raw.githubusercontent.com", 443, True),
        ("*.githubusercontent.com", "a.b.githubusercontent.com", 443, True),
        ("*.githubusercontent.com", "githubusercontent.com", 443, False),
        ("*.githubusercontent.com", "evilgithubusercontent.com", 443, False),
        ("pypi.org:*", "pypi.org", 22, True),
        ("127.0.0.1:8080", "127.0.0.1", 8080, True),
        ("127.0.0.1:8080", "127.0.0.1", 8081, False),
        ("127.0.0.1:8080", "localhost", 8080, False),  # a name is not the address
        ("10.0.0.0/8:*", "10.1.2.3", 5432, True),
        ("[::1]:8080", "::1", 8080, True),
        ("*", "example.org", 443, True),
        ("*", "127.0.0.1", 443, False),  # any name, not any address
        ("*", "8.8.8.8", 443, True),
    ],
)
def test_an_entry_names_what_it_says(entry: str, host: str, port: int, ok: bool) -> None:
    assert Rule.parse(entry).matches(host, port) is ok


@pytest.mark.parametrize(
    "bad",
    ["", "pypi.org:0", "pypi.org:70000", "pypi.org:http", "a b.org", "*.", "**.org",
     "[::1", "[::1]x", "http://pypi.org", "pypi.org/simple", "a..b", "-a.org", "x.org:²"],
)  # fmt: skip
def test_a_bad_entry_is_one_line_that_says_what_to_write(bad: str) -> None:
    with pytest.raises(ValidationError) as e:
        Settings(network={"allow": [bad]})
    message = str(e.value.errors()[0]["msg"])
    assert "\n" not in message and ("e.g." in message or "port" in message or "IPv6" in message)


def test_a_bad_network_in_an_agent_file_names_the_line() -> None:
    text = "---\nname: a\ndescription: d\nnetwork:\n  allow: [pypi.org, 'x y']\n---\nGo.\n"
    with pytest.raises(DefinitionError) as e:
        parse_agent(text, "a.md")
    assert str(e.value).startswith("a.md:4: ") and "'x y'" in str(e.value)
    with pytest.raises(DefinitionError, match="must be none, host or"):
        parse_agent("---\nname: a\ndescription: d\nnetwork: lan\n---\nGo.\n", "a.md")
    ok = parse_agent(
        "---\nname: a\ndescription: d\nnetwork: {allow: [PyPI.org.]}\n---\nGo.\n", "a.md"
    )
    assert ok.network == AllowList(allow=("pypi.org",))


def test_names_are_normalized_and_odd_ones_refused() -> None:
    assert normal_name("PyPI.Org.") == "pypi.org"
    assert normal_name("[::1]") == "::1"
    assert normal_name("bücher.example") == "xn--bcher-kva.example"
    assert normal_name("a b") is None and normal_name("a/b") is None and normal_name("") is None


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        ("8.8.8.8", True),
        ("127.0.0.1", False),
        ("10.1.1.1", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # the cloud metadata service
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::ffff:8.8.8.8", True),
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("2606:4700::1111", True),
        ("64:ff9b:1::a00:1", False),  # local-use NAT64 (RFC 8215)
        ("fec0::1", False),  # site-local
    ],
)
def test_only_global_addresses_are_public(address: str, ok: bool) -> None:
    assert public(ipaddress.ip_address(address)) is ok


def test_a_name_must_resolve_to_a_public_address_or_one_the_list_names() -> None:
    r = reach("svc.test:8080", "10.0.0.0/8:8080")
    assert r.check_name("svc.test", 8080) == ""
    assert r.check_address("svc.test", 8080, ipaddress.ip_address("8.8.8.8")) == ""
    assert r.check_address("svc.test", 8080, ipaddress.ip_address("10.2.3.4")) == ""
    why = r.check_address("svc.test", 8080, ipaddress.ip_address("127.0.0.1"))
    assert "not a public address" in why and "'127.0.0.1:8080'" in why
    assert "10.2.3.4" in reach("svc.test:8080").check_address(
        "svc.test", 8080, ipaddress.ip_address("10.2.3.4")
    )


def test_covers_is_what_narrowing_means() -> None:
    host, none = Reach("host"), Reach("none")
    wide = reach("*.github.com", "pypi.org:*", "10.0.0.0/8:*")
    assert host.covers(wide) and wide.covers(none) and not none.covers(wide)
    assert not wide.covers(host)
    assert wide.covers(reach("api.github.com", "a.b.github.com", "pypi.org:8443"))
    assert wide.covers(reach("10.1.0.0/16:5432"))
    assert not wide.covers(reach("github.com"))  # the apex is not below it
    assert not wide.covers(reach("api.github.com:22"))  # nor another port
    assert not wide.covers(reach("pypi.org", "evil.org"))
    assert not wide.covers(reach("11.0.0.0/8:1"))
    assert not reach("pypi.org").covers(reach("pypi.org:*"))
    assert not reach("pypi.org").covers(reach("*"))
    assert reach("*").covers(reach("pypi.org")) and not reach("*").covers(reach("127.0.0.1"))


def test_a_child_meets_its_parent() -> None:
    parent = reach("pypi.org", "*.github.com")
    assert Reach("host").meet(parent) == parent
    assert parent.meet(Reach("none")) == Reach("none") == Reach("none").meet(parent)
    assert parent.meet(Reach("host")) == parent
    child = reach("api.github.com", "evil.org")
    met = child.meet(parent)
    assert met.layers == (child.layers[0], parent.layers[0])  # each must pass
    assert met.check_name("api.github.com", 443) == ""
    assert "evil.org" in met.check_name("evil.org", 443)
    assert "pypi.org" in met.check_name("pypi.org", 443)
    assert reach("api.github.com").meet(parent) == reach("api.github.com")  # narrower: alone
    assert Reach.from_info(met.info()) == met
    assert Reach.from_info({"allow": ["x y"]}) == Reach("none")  # unreadable: none
    assert Reach.from_info(None) == Reach("none") and Reach.from_info("host") == Reach("host")


# -- the proxy, spoken to as a bridge would -------------------------------------------


async def _ask(door: Door, token: str, head: bytes, body: bytes = b"") -> bytes:
    try:
        reader, writer = await asyncio.open_unix_connection(str(door.socket))
    except OSError:  # a closed door: its socket is gone
        return b""
    writer.write(b"ORCH-EGRESS " + token.encode() + b"\n" + head + body)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"echo:" + await r.read())
        await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_the_proxy_tunnels_an_allowed_connect_and_refuses_the_rest() -> None:
    async def main() -> tuple[list[bytes], list[dict[str, Any]]]:
        server, port = await _echo_server()
        events: list[dict[str, Any]] = []
        async with server, EgressProxy() as proxy:
            door = await proxy.open_door(reach(f"127.0.0.1:{port}"), events.append)
            assert os.stat(door.socket).st_mode & 0o777 == 0o666
            assert os.stat(door.socket.parent).st_mode & 0o777 == 0o700
            # orch's private root: hidden in every host sandbox, never under TMPDIR
            assert door.socket.parent.parent == private_dir("egress")
            said = [
                await _ask(
                    door,
                    door.token,
                    f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode(),
                    b"ping",
                ),
                await _ask(
                    door, door.token, f"CONNECT 127.0.0.1:{port + 1} HTTP/1.1\r\n\r\n".encode()
                ),
                await _ask(
                    door, "not-the-token", f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode()
                ),
                await _ask(door, door.token, b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n"),
                await _ask(door, door.token, b"BREW /pot HTCPCP/1.0\r\n\r\n"),
            ]
            proxy.close_door(door)
            said.append(
                await _ask(door, door.token, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
            )
        return said, events

    said, events = asyncio.run(main())
    assert said[0].startswith(b"HTTP/1.1 200 Connection established\r\n\r\n")
    assert said[0].endswith(b"echo:ping")
    assert said[1].startswith(b"HTTP/1.1 403 Forbidden") and b"not in the run's network" in said[1]
    assert said[1].count(b"\n", said[1].index(b"\r\n\r\n") + 4) == 1  # a one-line reason
    assert said[2] == b""  # an unknown token: nothing at all
    assert said[3].startswith(b"HTTP/1.1 400") and b"CONNECT" in said[3]
    assert said[4].startswith(b"HTTP/1.1 400")
    assert said[5] == b""  # a closed door
    assert [e["allowed"] for e in events if "host" in e] == [True, False]
    assert events[0]["sent"] == 4 and events[0]["received"] == 9


def test_a_door_keeps_its_first_events_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxymod, "MAX_EVENTS", 3)

    async def main() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        async with EgressProxy() as proxy:
            door = await proxy.open_door(reach("pypi.org"), events.append)
            for _ in range(5):
                await _ask(door, door.token, b"CONNECT evil.org:443 HTTP/1.1\r\n\r\n")
            proxy.close_door(door)
        return events

    events = asyncio.run(main())
    assert len(events) == 4 and events[-1] == {"more": 2, "allowed": None}


def test_heads_are_read_strictly() -> None:
    plain = parse_head(
        b"GET http://Example.ORG:8080/a?b=1 HTTP/1.1\r\nHost: example.org\r\n"
        b"Proxy-Authorization: x\r\nConnection: keep-alive\r\n\r\n"
    )
    assert (plain.host, plain.port, plain.tunnel) == ("example.org", 8080, False)
    assert plain.forward == b"GET /a?b=1 HTTP/1.1\r\nHost: example.org\r\nConnection: close\r\n\r\n"
    assert split_target("[::1]:443") == ("::1", 443)
    for bad in ["example.org", "a b:1", "x:99999", "[::1]", ":443"]:
        with pytest.raises(Refused):
            split_target(bad)
