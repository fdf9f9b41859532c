"""The engine: where a ``task`` call becomes a child run.

- ``runner.py``: the :class:`Runner`, the one way in (``spawn``), the runs of this
  process, their places (``gate.py``) and their ends;
- ``admission.py``: what a spec is allowed to be (agent, model, tools, tier, depth,
  budgets), settled before anything is stored;
- ``execution.py``: one run from ``running`` to its ending: its workspace, its loop
  under its limits (timeout, stall watchdog, hooks);
- ``agent.py``: the model loop of one run on its own ``messages[]`` (``calls.py``: the
  tool calls of one turn; ``memory.py``: the project memory a run starts with;
  ``conversation.py``: a resumed conversation, a cut answer; ``context.py``: the view of
  the conversation that fits the model's window; ``budget.py``: a chain's dollars and
  tokens, checked before a request);
- ``delegation.py``: the ``task`` tool's side: a child spawned, waited for or moved to
  the background, and the ``Executor`` seam (where runs execute);
- ``owner.py``: who owns a run and how it shows it is alive (heartbeats, cancel requests).

Above it: ``process/`` (detached runs, the worker host, the cluster) and the CLI. Below
it: the catalog, the policy, the tools, the models, the store and the workspaces.
"""
