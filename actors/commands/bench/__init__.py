"""Benchmarks behind ``async-rl bench ...``; each writes its results as JSON."""
