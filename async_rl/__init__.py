"""async-rl: asynchronous off-policy RL for LLMs (MoE first).

The core library: configuration, wire schema, algorithms, weight buckets, the NATS
control plane, metrics and the CLI. Process loops live in :mod:`actors`, Redis
streams in :mod:`buffer`.
"""

__version__ = "0.1.0"
