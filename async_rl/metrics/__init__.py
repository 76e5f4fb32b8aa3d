"""What a run shows of itself: metrics sinks, Prometheus, and the scaling signal.

``sinks`` (wandb, online or offline, and a JSONL file beside the run), ``prometheus`` (a process's ``/metrics``,
off by default), ``scaling`` (how starved the learner is for rollouts, and how many generators would keep it
busy) and ``evaluation`` (an evaluation's scores per source: mean@n, pass@k, maj@k).

May import: process.
"""
