"""What every long-lived process shares, below everything else.

``lifecycle`` (tasks held in a TaskGroup, the first failure named, start-up errors, URLs with their passwords
redacted) and ``repeated`` (a condition that repeats is logged once, then summarised with a count).

May import: nothing of async_rl.
"""
