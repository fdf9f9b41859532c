"""What agents and skills a project has: their files, read once, and what is trusted.

- ``definitions.py``: agent and skill files (Claude Code's format, accepted unchanged)
  into a :class:`Catalog`;
- ``frontmatter.py``: the YAML front matter of those files, read strictly;
- ``owner.py``: whose each definition is, the user's or the repository's (one rule), and
  the one safe way the repository's files are read;
- ``agent_trust.py``: a project's settings and agent files under its trust decision
  (an untrusted file never weakens isolation);
- ``guidance.py``: what a run is told about its agents, skills and tier.
"""
