"""The ``orch`` command (and ``python -m orchestrator``): the warm process runs it if one
answers (``warm/``), else this process does."""

import os
import sys

from orchestrator.warm.client import run


def main() -> None:
    try:
        code = run(sys.argv[1:])
        if code is not None:
            sys.stdout.flush()
            os._exit(code)
        from orchestrator.cli.main import main as cli_main

        cli_main()
    except KeyboardInterrupt:  # Ctrl+C while it starts: as in a command, one line
        sys.stderr.write("orch: interrupted\n")
        os._exit(130)


if __name__ == "__main__":
    main()
