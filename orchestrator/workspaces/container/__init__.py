"""The container tier: a run works in a locked-down Docker container (``workspace.py``).

Host side: ``workspace.py`` (the tier's config and workspace), ``docker.py`` (the engine:
client, labels, making and reaping containers), ``pool.py`` (started containers kept
warm), ``dockerexec.py`` (exec with capped output), ``channel.py`` (the host's side of
the program server), ``runtime.py`` (the file tools, run inside), ``transfer.py``
(bundles and archives in and out), ``export.py`` (the work out at close, the salvage
after a crash). ``inside/``: the stdlib-only programs that run *in* the container
(``server.py``, the program server; ``files.py``, the file tools); the host reads their
source and never imports orch into the container.
"""

from __future__ import annotations

from .pool import ContainerPool
from .workspace import ContainerConfig, ContainerWorkspace

__all__ = ["ContainerConfig", "ContainerPool", "ContainerWorkspace"]
