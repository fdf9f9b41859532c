"""What runs inside a sandbox container: stdlib-only programs sent as ``python3 -c``
(their source is read on the host; nothing of orch is imported in the container)."""
