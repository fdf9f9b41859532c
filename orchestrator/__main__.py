"""The ``orch`` command (and ``python -m orchestrator``): the warm process runs it if one
answers (``warm/``), else this process does."""

import os
import sys

from orchestrator.warm.client import run


def main() -> None:
    code = run(sys.argv[1:])
    if code is not None:
        sys.stdout.flush()
        os._exit(code)
    from orchestrator.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
