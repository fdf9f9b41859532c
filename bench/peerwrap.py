"""Run `orch` as its console script does, stamping the edges (bench/peerprofile.py only).

    python peerwrap.py STAMPS [PROFILE] -- orch-args...

Writes ``time.perf_counter()`` stamps (CLOCK_MONOTONIC: the same clock as the
fake server's in another process) to STAMPS as JSON: ``main`` (wrapper running,
before orch is imported), ``imported`` (``orchestrator.cli.main`` imported),
``exit_called`` (orch's ``main`` calls ``os._exit``: the CLI is done). With
PROFILE, the whole of orch's ``main`` runs under cProfile, dumped there.
"""

from __future__ import annotations

import cProfile
import json
import os
import sys
import time
from typing import NoReturn

t_main = time.perf_counter()


def wrapped() -> None:
    stamps_path, *rest = sys.argv[1 : sys.argv.index("--")]
    args = sys.argv[sys.argv.index("--") + 1 :]
    prof = cProfile.Profile() if rest else None
    if prof:
        prof.enable()
    from orchestrator.cli import main as cli  # noqa: PLC0415 (timed on purpose)

    stamps = {"main": t_main, "imported": time.perf_counter()}
    real_exit = os._exit

    def stamped_exit(code: int) -> NoReturn:
        stamps["exit_called"] = time.perf_counter()
        if prof:
            prof.disable()
            prof.dump_stats(rest[0])
        with open(stamps_path, "w") as f:
            json.dump(stamps, f)
        real_exit(code)

    os._exit = stamped_exit  # type: ignore[assignment]
    sys.argv = ["orch", *args]
    cli.main()


if __name__ == "__main__":
    wrapped()
