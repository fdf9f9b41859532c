"""What a run's network may reach: the ``network`` setting, its allow-list rules, and the
:class:`Reach` a run gets (its own setting, never wider than its parent's).

``network`` is ``"none"`` (the default: no network at all), ``"host"`` (the machine's
network, unfiltered) or ``{allow = [...]}``: every connection goes through orch's egress
proxy (:mod:`.proxy`), which lets through only what an entry names:

- ``pypi.org``: that name; ``*.githubusercontent.com``: any name below it (not the name
  itself); ``*``: any name;
- ``127.0.0.1``, ``10.0.0.0/8``, ``[::1]``: an address or a range (also what a name may
  resolve to, see below);
- ``:PORT`` after any of them (``127.0.0.1:8080``, ``[::1]:8080``): that port; ``:*``: any
  port; none: ports 80 and 443.

A name that passes must also resolve to an address the list allows: a public one, or a
loopback, link-local, private or otherwise non-public one only when an address entry of the
list names it (so a name cannot be pointed at the host's own services: DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
WEB_PORTS = frozenset({80, 443})
MAX_ENTRIES = 256
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_EXAMPLES = "e.g. 'pypi.org', '*.github.com', '127.0.0.1:8080'"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPATIBLE = ipaddress.ip_network("::/96")  # IPv4-compatible ::a.b.c.d (deprecated)
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # IPv4-translated ::ffff:0:a.b.c.d
_LOOPBACK = {4: ipaddress.ip_network("127.0.0.0/8"), 6: ipaddress.ip_network("::1/128")}
# not global, though Python 3.11's is_global says so: local NAT64, site-local
_LOCAL = (ipaddress.ip_network("64:ff9b:1::/48"), ipaddress.ip_network("fec0::/10"))


class AllowList(BaseModel):
    """``network = {allow = [...]}``: the entries (:class:`Rule`) a run's connections may
    reach through the egress proxy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: tuple[str, ...]

    @field_validator("allow")
    @classmethod
    def _entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} entries in network.allow")
        return tuple(Rule.parse(v).text for v in value)


NetworkMode = Literal["none", "host"]


def parse_setting(value: object) -> NetworkMode | AllowList:
    """A ``network`` value as read from a file (settings, agent frontmatter, team file);
    ValueError with the one line to show."""
    if isinstance(value, AllowList):
        return value
    if value in ("none", "host"):
        return "none" if value == "none" else "host"
    listed = isinstance(value, dict) and isinstance(value.get("allow"), list | tuple)
    if isinstance(value, dict) and set(value) == {"allow"} and listed:
        entries = value["allow"]
        if not all(isinstance(v, str) for v in entries):
            raise ValueError(f"every network.allow entry must be a string ({_EXAMPLES})")
        if len(entries) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} entries in network.allow")
        return AllowList(allow=tuple(Rule.parse(v).text for v in entries))
    raise ValueError(
        "'network' must be none, host or {allow: [...]} "
        f"({_EXAMPLES} in the list), not {str(value)[:80]!r}"
    )


# "none", "host" or {allow = [...]}: a bad value is one line (parse_setting), not a union's
NetworkSetting = Annotated[NetworkMode | AllowList, BeforeValidator(parse_setting)]


def normal_name(name: str) -> str | None:
    """A host name or address as asked for, lower case without a trailing dot (an IPv6
    address without brackets); None when it is neither a name nor an address."""
    name = name.strip().lower().removesuffix(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    return name if len(name) <= 253 and _NAME.match(name) else None


def as_address(name: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def carried(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries in its last 32 bits and stands for: IPv4-mapped
    ``::ffff:a.b.c.d``, IPv4-compatible ``::a.b.c.d`` and IPv4-translated
    ``::ffff:0:a.b.c.d``; None for any other (``::`` and ``::1`` are IPv6's own)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if (address in _COMPATIBLE and int(address) > 1) or address in _TRANSLATED:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def classed(address: IPAddress) -> IPAddress:
    """The address as the rules class it: the IPv4 one it carries (:func:`carried`), or
    itself."""
    return carried(address) or address


def public(address: IPAddress) -> bool:
    """A global unicast address, also when another address wraps it (IPv4-mapped,
    -compatible or -translated, 6to4, Teredo, NAT64): anything else is the host's own, a
    private network's or reserved. An address carrying an IPv4 one is that one."""
    if (inner4 := carried(address)) is not None:
        return public(inner4)
    if isinstance(address, ipaddress.IPv6Address):
        inner = [address.ipv4_mapped, address.sixtofour]
        inner += list(address.teredo or ())
        if address in _NAT64:
            inner.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if any(a is not None and not public(a) for a in inner):
            return False
        if any(address in net for net in _LOCAL):
            return False
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class Rule:
    """One allow-list entry: a name pattern or an address range, and its ports."""

    text: str  # as written back (normalized)
    name: str | None  # "pypi.org", "*.x.org" or "*"; None for an address range
    network: IPNetwork | None
    ports: frozenset[int] | None  # None: any port

    @classmethod
    def parse(cls, text: str) -> Rule:
        raw = text.strip().lower()
        try:
            host, port_text = split_host_port(raw)
        except ValueError as e:
            raise ValueError(f"network.allow entry {text!r}: {e}") from None
        if host.endswith(".") and not host.endswith("..") and host != "*.":
            host = host[:-1]  # a fully qualified name's dot
        if port_text is None:
            ports: frozenset[int] | None = WEB_PORTS
        elif port_text == "*":
            ports = None
        elif port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535:
            ports = frozenset({int(port_text)})
        else:
            raise ValueError(f"network.allow entry {text!r}: the port must be 1-65535 or *")
        try:
            network: IPNetwork | None = ipaddress.ip_network(host, strict=False)
        except ValueError:
            network = None
        name = None
        if network is None:
            bare = host.removeprefix("*.")
            if host != "*" and (normal_name(bare) != bare or as_address(bare) is not None):
                raise ValueError(f"network.allow entry {text!r} is not a host name ({_EXAMPLES})")
            name = host
        shown = host if network is None else str(network).removesuffix(_full(network))
        if network is not None and network.version == 6:
            shown = f"[{shown}]"
        if port_text is not None:
            shown += f":{port_text}"
        return cls(shown, name, network, ports)

    def port_ok(self, port: int) -> bool:
        return self.ports is None or port in self.ports

    def matches(self, host: str, port: int) -> bool:
        """``host`` (normalized: ``normal_name``) at ``port`` is what this entry names."""
        if not self.port_ok(port):
            return False
        address = as_address(host)
        if self.network is not None:
            return address is not None and self._names(address)
        if self.name == "*":
            return address is None or public(address)
        if address is not None or self.name is None:
            return False
        if self.name.startswith("*."):
            return host.endswith(self.name[1:])
        return host == self.name

    def lists(self, address: IPAddress, port: int) -> bool:
        """This entry names ``address`` itself (an address range), at ``port``."""
        return self.network is not None and self._names(address) and self.port_ok(port)

    def _names(self, address: IPAddress) -> bool:
        """The range holds ``address``, or the IPv4 address it carries."""
        assert self.network is not None
        return address in self.network or classed(address) in self.network

    def covers(self, other: Rule) -> bool:
        """Everything ``other`` lets through, this entry does too."""
        if self.ports is not None and (other.ports is None or not other.ports <= self.ports):
            return False
        if self.network is not None or other.network is not None:
            return (
                self.network is not None
                and other.network is not None
                and self.network.version == other.network.version
                and other.network.subnet_of(self.network)  # type: ignore[arg-type]
            )
        mine, theirs = self.name or "", other.name or ""
        if mine == "*":
            return True
        if mine.startswith("*."):
            return theirs != "*" and theirs.removeprefix("*").endswith(mine[1:])
        return theirs == mine


def _full(network: IPNetwork) -> str:
    return f"/{network.max_prefixlen}"


def split_host_port(text: str) -> tuple[str, str | None]:
    """``host:port``, ``[v6]:port``, ``host``, ``[v6]`` or a bare IPv6 address as the host
    and the port's text (None: none written); ValueError when brackets do not close."""
    if text.startswith("["):
        inside, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("write an IPv6 address as [::1]:8080")
        return inside, rest[1:] if rest else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, None  # a name, or a bare IPv6 address (or range)


Layer = tuple[Rule, ...]


@dataclass(frozen=True)
class Reach:
    """The network of one run: ``none``, ``host``, or ``allow`` with its layers: its own
    list and those of every ancestor that had one (a connection must pass each)."""

    mode: Literal["none", "host", "allow"]
    layers: tuple[Layer, ...] = ()

    @classmethod
    def of(cls, setting: NetworkSetting) -> Reach:
        if isinstance(setting, AllowList):
            return cls("allow", (tuple(Rule.parse(t) for t in setting.allow),))
        return cls(setting)

    def meet(self, parent: Reach) -> Reach:
        """This network, never wider than ``parent``'s."""
        if self.mode == "none" or parent.mode == "none":
            return Reach("none")
        if parent.mode == "host":
            return self
        if self.mode == "host":
            return parent
        kept: list[Layer] = []
        for layer in [*self.layers, *parent.layers]:
            if any(_layer_covers(layer, k) for k in kept):
                continue  # it lets through all a kept one does: it adds nothing
            kept = [k for k in kept if not _layer_covers(k, layer)]
            kept.append(layer)
        return Reach("allow", tuple(kept))

    def covers(self, other: Reach) -> bool:
        """Everything ``other`` reaches, this network reaches too (``other`` is not wider)."""
        if self.mode == "host" or other.mode == "none":
            return True
        if self.mode == "none" or other.mode == "host":
            return False
        return all(
            any(_layer_covers(mine, theirs) for theirs in other.layers) for mine in self.layers
        )

    def check_name(self, host: str, port: int) -> str:
        """Why ``host:port`` (``normal_name``'d) is refused by name; "" when every layer
        names it."""
        if self.mode != "allow":
            return "this run has no network" if self.mode == "none" else ""
        for layer in self.layers:
            if not any(rule.matches(host, port) for rule in layer):
                shown = f"[{host}]" if ":" in host else host
                return f"{shown}:{port} is not in the run's network allow-list"
        return ""

    def check_address(self, host: str, port: int, address: IPAddress) -> str:
        """Why a connection to ``address`` (what ``host`` resolved to) is refused; ""
        when allowed: a public address, or one an address entry of every layer lists."""
        if public(address):
            return ""
        for layer in self.layers:
            if not any(rule.lists(address, port) for rule in layer):
                return (
                    f"{host} resolves to {address}, not a public address, and the allow-list "
                    f"does not name it (list '{_entry(address, port)}' to allow it)"
                )
        return ""

    def names_loopback(self) -> bool:
        """Every layer names a loopback address: the host's loopback is reachable through
        the proxy (so a sandbox's ``NO_PROXY`` must not send loopback around it)."""
        return self.mode == "allow" and all(
            any(
                r.network is not None and r.network.overlaps(_LOOPBACK[r.network.version])
                for r in layer
            )
            for layer in self.layers
        )

    def info(self) -> str | dict[str, Any]:
        """As a run's record keeps it (``from_info`` reads it back)."""
        if self.mode != "allow":
            return self.mode
        first, *more = self.layers
        shown: dict[str, Any] = {"allow": [r.text for r in first]}
        if more:
            shown["within"] = [[r.text for r in layer] for layer in more]
        return shown

    @classmethod
    def from_info(cls, value: object) -> Reach:
        """A record's ``network`` (``info``); anything unreadable is ``none``."""
        if value == "host":
            return cls("host")
        if not isinstance(value, dict) or not isinstance(value.get("allow"), list):
            return cls("none")
        lists = [value["allow"], *(value.get("within") or [])]
        try:
            layers = tuple(tuple(Rule.parse(str(t)) for t in layer) for layer in lists)
        except (ValueError, TypeError):
            return cls("none")
        return cls("allow", layers)

    def describe(self) -> str:
        """One line for a person or a model: what this network reaches."""
        if self.mode == "none":
            return "no network"
        if self.mode == "host":
            return "the machine's network, unfiltered"
        entries = ", ".join(r.text for r in self.layers[0])
        more = " (within its parent's list)" if len(self.layers) > 1 else ""
        return f"only {entries or 'nothing'}{more}, through orch's egress proxy"


def _layer_covers(mine: Layer, theirs: Layer) -> bool:
    """Every entry of ``theirs`` is covered by an entry of ``mine``."""
    return all(any(m.covers(t) for m in mine) for t in theirs)


def _entry(address: IPAddress, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
