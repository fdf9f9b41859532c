"""What agents and skills a project has: their files, read once, and what is trusted.

- ``definitions.py``: agent and skill files (Claude Code's format, accepted unchanged)
  into a :class:`Catalog`;
- ``frontmatter.py``: the YAML front matter of those files, read strictly;
- ``agent_trust.py``: a project's settings and agent files under its trust decision
  (an untrusted file never weakens isolation);
- ``guidance.py``: what a run is told about its agents, skills and tier.
"""
