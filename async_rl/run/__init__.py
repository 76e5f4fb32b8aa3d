"""A run's identity: where a process finds it and the names of everything it owns.

``config`` (the key prefix and the Redis / NATS URLs), ``names`` (every Redis key and NATS subject, built in
exactly one place), ``listing`` (which runs a Redis holds; the line that says a prefix names none), ``end``
(the end of a run, announced and recorded so that every process ends with it) and ``lease`` (one learner per run: the
run's lease and the fencing token every learner write carries).

May import: process, servers.
"""
