"""What a request costs in US dollars, and how large a model's context window is.

The table is ``genai-prices`` (pydantic's maintained table of providers' prices, with
their tiers and cache prices, and each model's context window); ``[prices."MODEL"]`` in the
settings overrides it (a private deployment, a negotiated rate) and ``[context] windows``
its windows. A cache write costs as the Messages API charges it: 1.25x input for five
minutes, 2x for an hour; a read 0.1x. A model neither knows is priced at 0 (``known`` says
so): its runs still count tokens, and a dollar budget cannot see them (docs/MODELS.md).

The library (≈ 0.2 s to import) is imported at the first price asked for, not with this
module; a price is looked up per model once and kept.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass

from .base import ModelUsage
from .config import Price

MILLION = 1_000_000
UNPRICED = "n/a"  # the cost of tokens no price is known for (a model missing from the table)
# a model spec's provider prefix -> the provider genai-prices files its models under
_PROVIDERS = {"anthropic/": "anthropic", "openai/": "openai", "openrouter/": "openrouter"}


@dataclass(frozen=True)
class Rates:
    """USD per million tokens of each kind."""

    input: float
    output: float
    cache_write: float
    cache_write_1h: float
    cache_read: float

    @classmethod
    def of(cls, price: Price) -> Rates:
        return cls(
            input=price.input,
            output=price.output,
            cache_write=price.input * 1.25 if price.cache_write is None else price.cache_write,
            cache_write_1h=price.input * 2
            if price.cache_write_1h is None
            else price.cache_write_1h,
            cache_read=price.input * 0.1 if price.cache_read is None else price.cache_read,
        )

    def cost(self, usage: ModelUsage, ttl: str = "5m") -> float:
        write = self.cache_write_1h if ttl == "1h" else self.cache_write
        return (
            usage.input_tokens * self.input
            + usage.output_tokens * self.output
            + usage.cache_creation_input_tokens * write
            + usage.cache_read_input_tokens * self.cache_read
        ) / MILLION


def split(spec: str) -> tuple[str | None, str]:
    """(genai-prices' provider id or None, the model id) of a model spec."""
    if spec in ("scripted", "model") or spec.startswith("scripted:"):  # a script, a test's
        return None, spec
    for prefix, provider in _PROVIDERS.items():
        if spec.startswith(prefix):
            return provider, spec.removeprefix(prefix)
    if "/" in spec or ":" in spec:  # a named endpoint's or a script's: no public table
        return None, spec.split("/", 1)[-1]
    return "anthropic", spec  # a bare id goes to the Anthropic API (models/registry.py)


@functools.lru_cache(maxsize=256)
def _table(spec: str) -> tuple[Rates | None, int | None]:
    """The table's rates (below any long-context tier) and window for ``spec``."""
    provider, model = split(spec)
    if provider is None:
        return None, None
    try:
        from genai_prices import Usage, calc_price
    except ImportError:  # pragma: no cover - a dependency; a broken install prices nothing
        return None, None
    probe = 1000  # tokens of each kind: far below any tier's threshold

    def price(**kinds: int) -> float:
        usage = Usage(**kinds)
        found = calc_price(usage, model_ref=model, provider_id=provider)
        return float(found.total_price) * MILLION / probe

    try:
        found = calc_price(Usage(input_tokens=probe), model_ref=model, provider_id=provider)
    except LookupError:
        return None, None
    window = getattr(found.model, "context_window", None)
    base = float(found.total_price) * MILLION / probe
    rates = Rates(input=base, output=base, cache_write=base, cache_write_1h=base, cache_read=base)
    with contextlib.suppress(Exception):  # a kind the table lacks keeps the input price
        rates = Rates(
            input=base,
            output=price(output_tokens=probe),
            cache_write=price(input_tokens=probe, cache_write_tokens=probe),
            cache_write_1h=price(
                input_tokens=probe, cache_write_tokens=probe, cache_write_1h_tokens=probe
            ),
            cache_read=price(input_tokens=probe, cache_read_tokens=probe),
        )
    return rates, window if isinstance(window, int) and window > 0 else None


def rates(spec: str, prices: Mapping[str, Price] | None = None) -> Rates | None:
    """The rates of the model ``spec`` names: the settings' ``prices`` (by the spec, or by
    the id without its prefix), else the table's; None when neither knows it."""
    for key in (spec, split(spec)[1]):
        if prices and key in prices:
            return Rates.of(prices[key])
    return _table(spec)[0]


def known(spec: str, prices: Mapping[str, Price] | None = None) -> bool:
    return rates(spec, prices) is not None


def cost(
    spec: str, usage: ModelUsage, *, ttl: str = "5m", prices: Mapping[str, Price] | None = None
) -> float:
    """What one request of ``usage`` to the model ``spec`` costs in USD (0 if unknown)."""
    found = rates(spec, prices)
    return 0.0 if found is None else found.cost(usage, ttl)


def window(spec: str, windows: Mapping[str, int] | None = None) -> int | None:
    """The context window of the model ``spec`` in tokens: the settings' ``[context]
    windows`` (by the spec or its id), else the table's; None when neither knows it."""
    for key in (spec, split(spec)[1]):
        if windows and key in windows:
            return windows[key]
    return _table(spec)[1]


def money(usd: float, *, unpriced: bool = False) -> str:
    """A cost as every view and message writes it: ``$0.05``, ``$0.0512`` under a dollar (to
    four decimals, at least two), ``$12.50`` from one; ``<$0.0001``; nothing spent ``$0``;
    an unknown price ``n/a`` (never ``$0``), a sum that holds some unknown ``≥$0.0123``."""
    if usd <= 0:
        return UNPRICED if unpriced else "$0"
    if usd < 0.00005:
        text = "<$0.0001"
    elif usd >= 0.995:
        text = f"${usd:,.2f}"
    else:
        cents = f"{usd:.4f}".partition(".")[2]
        text = f"$0.{cents.rstrip('0').ljust(2, '0')}"
    return f"≥{text}" if unpriced else text
