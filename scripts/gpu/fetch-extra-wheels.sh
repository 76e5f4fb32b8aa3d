#!/usr/bin/env bash
# Run here, in the project root, after ../shared/gpu/fetch-wheels.sh: the wheels this project's GPU tests need beyond
# that list, into .whl/ (git-ignored), so a device call that carries .whl gets them. pytest-asyncio: the GPU tests use
# the suite's async fixtures (real Redis and NATS, tests/conftest.py); the GPU image has pytest but not this plugin.
# py-spy: a process's Python stacks sampled from outside (a generator's front end and engine core on the node; record
# with -f raw --threads, then scripts/gpu/pyspy_summary.py: the raw file of 25 s is over what a device call returns).
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "pytest-asyncio>=0.24" 2>&1 | grep -v WARNING || true
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d .whl "py-spy>=0.4" 2>&1 \
    | grep -v WARNING || true
ls .whl
