"""A real multi-node Ray cluster on loopback, in a child process, for the tests.

``python tests/raycluster.py DIR [SLOTS]`` starts a head node and one worker node (``ray``'s
own ``cluster_utils.Cluster``: real raylets, a real GCS, separate node ids), all on
127.0.0.1, each with ``SLOTS`` orch_slots (default 2), writes ``DIR/cluster.json``
(address, node ids) and then obeys lines on stdin:

- ``add SLOTS``: one more worker node with ``SLOTS`` orch_slots; answers its node id;
- ``kill NODE_ID``: kills that node's processes at once (a machine that dies);
- ``quit``: shuts the cluster down.

Ray 2.x resolves ``127.0.0.1`` to this machine's routable address once multi-node
clusters are enabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, the default on Linux), so
its processes would talk over that address; here everything must stay on loopback, so
the variable is ``0`` (loopback as the node address) and the nodes are started through
``cluster_utils`` (which does not refuse several nodes in that mode). Every process of
the cluster and every driver that joins it (the ``orch`` commands) get that variable.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def main(where: Path, slots: float = 2) -> None:
    os.environ.update(LOOPBACK_ENV)
    from ray.cluster_utils import Cluster

    common: dict[str, Any] = {"node_ip_address": "127.0.0.1", "num_cpus": 2}
    cluster: Any = Cluster(
        initialize_head=True,
        head_node_args={
            **common, "resources": {"orch_slots": slots}, "include_dashboard": False,
            "_system_config": {"health_check_failure_threshold": 3,
                               "health_check_period_ms": 1000},
        },
    )  # fmt: skip
    nodes = {cluster.head_node.node_id: cluster.head_node}
    worker = cluster.add_node(**common, resources={"orch_slots": slots})
    nodes[worker.node_id] = worker
    cluster.wait_for_nodes()
    info = {
        "address": cluster.address,
        "head": cluster.head_node.node_id,
        "worker": worker.node_id,
        "temp_dir": cluster.head_node.get_temp_dir_path(),
    }
    (where / "cluster.json").write_text(json.dumps(info))
    print("ready", flush=True)
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "add":
            node = cluster.add_node(**common, resources={"orch_slots": float(arg)})
            cluster.wait_for_nodes()
            nodes[node.node_id] = node
            print(node.node_id, flush=True)
        elif verb == "kill":
            cluster.remove_node(nodes.pop(arg), allow_graceful=False)
            print("killed", flush=True)
        elif verb == "quit":
            break
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(float(a) for a in sys.argv[2:3]))
