"""The warm process: ``orch`` commands forked from a process that has imported them already.

Importing the CLI, the engine and the Anthropic SDK takes about a second; the work of a
short command takes a few milliseconds. So the ``orch`` entry point (``client.py``, standard
library only) first asks a *warm process* to run the command: a process of the same user,
environment, Python and orch code that has imported everything once and forks one child
per command. The child takes the caller's working directory and its stdin, stdout and
stderr (passed as descriptors over a Unix socket, ``SCM_RIGHTS``), then runs the very
same ``cli.main.main`` on the caller's argv; the caller relays signals to it and leaves
with its exit status. When no warm process answers, the command runs in its own process
as before, and then (at its exit) starts a warm process for the next one (which exits after
``ORCH_WARM_IDLE`` seconds without a command, default 60; ``0`` or
``ORCH_WORKER_HOST=0`` turns it off). One that cannot start (an import fails) leaves
``KEY.failed`` saying why, and commands of that key run alone without trying again.

What a command sees is what it would see in its own process: the environment is the
caller's own (sent whole, and the only one the command has), the warm process is
compatible by construction (the digest of the environment, the umask, the Python,
``sys.path``, the size and mtime of every orch source file, the installed distributions,
and what a process inherits besides (ids, groups, limits, priority, cgroup, CPUs,
interpreter flags) names the socket: any difference means another warm process), the
working directory and standard streams are the caller's own, and the warm process itself
never starts a thread or an event loop, so a fork copies no held lock.

Trust: the socket and its lock live in ``~/.orch/warm`` (mode 0700; ``~/.orch`` is
hidden from host-tier sandboxes). A connection is served only when its peer has our uid
and our mount, pid, network and user namespaces (``SO_PEERCRED`` and ``/proc``): a
process inside a sandbox is refused even where it could reach the socket, and so is one
that differs from the warm process in what a process inherits besides its environment
(limits, umask, groups, capabilities, ``no_new_privs``, seccomp, cgroup, OOM score,
priority, scheduling policy: read from ``/proc``, never taken from the message). The
message carries argv and the caller's whole environment, and the command runs with that
environment, never the warm process's: the socket's name (a digest) only picks a
compatible warm process and grants nothing. A caller without the API key runs its command
without it; one inside an agent's chain (``ORCH_PARENT_RUN_ID``...) stays in that chain,
at its depth, under its budgets.
"""
