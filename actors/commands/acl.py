"""``async-rl acl``: a Valkey/Redis ACL file giving each role of a run least privilege over the run's keys.

Roles (user ``<prefix>-<role>``; passwords generated here, written one per file with mode 0600, stored in
the ACL file only as SHA-256 hashes, never printed):

* ``generator``: read prompts through the consumer group (and ack, reclaim, release, set poison ones aside),
  append rollouts (inline or under a payload key) and read the acks that lift back-pressure (and, from the
  learner's state, how many groups it holds until its next checkpoint), read weight
  versions and lease them, read the end-of-run record. It cannot add prompts, delete keys, write weights,
  read or write anything outside ``<prefix>:``, or run administrative commands.
* ``learner``: any data command on ``<prefix>:*``; no administrative or dangerous command (``FLUSHALL``,
  ``KEYS``, ``CONFIG``, ``DEBUG``...).
* ``reader``: read-only on ``<prefix>:*`` (``async-rl status``, ``async-rl audit``).
* ``admin``: everything (the operator); the file also turns the password-less ``default`` user off.

The same users and passwords get NATS permissions (``nats-users.conf``, for ``include`` in the NATS server's
config; the file holds the passwords, so it is written 0600 like the password files): the generator may publish
only heartbeats and subscribe only to weight announcements and control messages; the learner may publish and
subscribe on its run's subjects; the reader may only subscribe to them; nobody may touch another run's subjects.

Every command of a user goes through a selector that names both the commands and the keys it may touch
(Redis 7 / Valkey selectors), so e.g. the generator's ``XADD`` reaches the rollout stream and the dead
letters but never the prompt stream. Scripts the buffer runs (``EVAL``) are checked command by command
against the same rules. Use the credentials in the URLs: ``redis://<prefix>-generator:<password>@host:6379/0``
(``rediss://`` for TLS).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
from pathlib import Path

from async_rl.entry import first_sentence
from async_rl.run.names import Names

ROLES = ("learner", "generator", "reader", "admin")
# Connection housekeeping every client needs (redis-py sends HELLO / CLIENT SETINFO; the transport AUTH, SELECT),
# and MULTI/EXEC: the buffer's writes go in transactions (each queued command is still checked on its own).
_CONNECTION = ("+auth +hello +ping +select +client|setinfo +client|setname +client|getname +client|id +echo"
               " +multi +exec +discard +time")


def generator_selectors(n: Names) -> list[str]:
    """The generator's selectors: ``(keys commands)`` groups, one per resource of the run."""
    p = n.prefix
    return [
        # prompts: consume through the group (read, ack, reclaim, release, touch), never add
        f"(~{n.prompts_stream} +xreadgroup +xack +xclaim +xautoclaim +xpending +xdel +xgroup|create +xinfo|groups)",
        # evaluation: held-out prompts through their own group; the result, the ack and the fate in one transaction
        f"(~{n.evaluation.prompts_stream} +xlen +xreadgroup +xack +xclaim +xautoclaim +xpending +xdel +xgroup|create "
        "+xinfo|groups)",
        f"(~{n.eval_results_stream} +xadd)",
        f"(~{n.evaluation.audit_open} ~{n.evaluation.audit_fates} ~{n.evaluation.audit_counters} "
        f"~{n.evaluation.prompt_counters} +eval +evalsha +hdel +xadd +hincrby)",
        # rollouts: append, records beside the stream, back-pressure
        f"(~{n.rollouts_stream} +xadd +xlen)",
        f"(~{n.rollout_payload('*')} +set)",
        f"(~{n.rollout_counters} ~{n.prompt_counters} +hincrby)",
        f"(%R~{n.rollout_acks_stream} +xread +xrevrange)",
        f"(%R~{n.learner_state} +hget)",  # the groups the learner holds until its checkpoint count beside the bound
        # poison prompts set aside (dead letters, their fate in the audit: the buffer's scripts)
        f"(~{n.dead_letters_stream} +xadd)",
        f"(~{n.audit_open} ~{n.audit_fates} ~{n.audit_counters} +eval +evalsha +hdel +xadd +hincrby)",
        # weights: read versions, lease the one being read (a script over the manifest and the readers' set)
        # (EVAL's declared keys need read and write; the script's own commands are checked one by one, and none
        # may write a manifest: only the readers' lease set is writable)
        f"(%R~{p}:weights:* %R~{p}:run:* +get +strlen +exists +zrange +zscore +hget +hgetall)",
        f"(~{p}:weights:*:manifest ~{p}:weights:*:readers +eval +evalsha)",
        f"(~{p}:weights:*:readers +zadd +zrem +zrange +pexpireat)",
        # ask for a full version (a late joiner, a refused delta): the publisher takes the set before its next one
        f"(~{n.weights_want_full} +zadd)",
        # peer relay (peer://): register as a source of a version, pick a parent (async_rl/weights/peer/topology.py scripts)
        f"(~{p}:weights:*:relays +eval +evalsha +hset +hdel +hgetall +pexpire)",
        "(+script|load)",
    ]


def acl_lines(names: Names, passwords: dict[str, str]) -> list[str]:
    """ACL file lines for every role of ``names``' run (passwords as SHA-256 hashes)."""
    p = names.prefix

    def h(role: str) -> str:
        return "#" + hashlib.sha256(passwords[role].encode()).hexdigest()

    return [  # an ACL file has no comments: every line is a user
        "user default off resetkeys resetchannels -@all",
        f"user {p}-admin on {h('admin')} ~* &* +@all",
        f"user {p}-learner on {h('learner')} resetkeys ~{p}:* resetchannels -@all +@all -@admin -@dangerous"
        " -script|flush -function",
        f"user {p}-reader on {h('reader')} resetkeys %R~{p}:* resetchannels -@all +@read -@dangerous {_CONNECTION}",
        f"user {p}-generator on {h('generator')} resetkeys resetchannels -@all {_CONNECTION} "
        + " ".join(generator_selectors(names)),
    ]


def nats_permissions(names: Names) -> dict[str, dict[str, list[str]]]:
    """Per role, the NATS subjects it may publish and subscribe to (the run's own, see :mod:`async_rl.run.names`)."""
    everything = names.subject(">")
    return {
        "learner": {"publish": [everything], "subscribe": [everything, "_INBOX.>"]},
        "generator": {"publish": [names.heartbeat_subject],
                      "subscribe": [names.weights_subject, names.control_subject]},  # fmt: skip
        "reader": {"publish": [], "subscribe": [everything, "_INBOX.>"]},
    }


def nats_config(names: Names, passwords: dict[str, str]) -> str:
    """A NATS ``authorization`` block with one user per role (``admin`` may do anything)."""
    users = [f"    {{user: {json.dumps(f'{names.prefix}-admin')}, password: {json.dumps(passwords['admin'])}}}"]
    for role, perms in nats_permissions(names).items():
        allow = ", ".join(f"{kind}: {{allow: {json.dumps(subjects)}}}" if subjects else f"{kind}: {{deny: [\">\"]}}"
                          for kind, subjects in perms.items())  # fmt: skip
        users.append(f"    {{user: {json.dumps(f'{names.prefix}-{role}')}, password: {json.dumps(passwords[role])}, "
                     f"permissions: {{{allow}}}}}")  # fmt: skip
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def _private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def write_acl(names: Names, out_dir: Path) -> tuple[Path, dict[str, Path]]:
    """Write ``<out_dir>/users.acl``, ``<out_dir>/nats-users.conf`` (0600) and one ``<role>.password`` file per role
    (0600); returns the ACL's path and the password files'."""
    out_dir.mkdir(parents=True, exist_ok=True)
    passwords = {role: secrets.token_urlsafe(24) for role in ROLES}
    files: dict[str, Path] = {}
    for role, password in passwords.items():
        files[role] = _private(out_dir / f"{role}.password", password + "\n")
    acl = out_dir / "users.acl"
    acl.write_text("\n".join(acl_lines(names, passwords)) + "\n")
    _private(out_dir / "nats-users.conf", nats_config(names, passwords))
    return acl, files


def main(argv: list[str] | None = None, prog: str = "async-rl acl") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    ap.add_argument("--run", required=True, metavar="PREFIX", help="run prefix (run.prefix of the learner)")
    ap.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for users.acl and passwords")
    args = ap.parse_args(argv)
    try:
        names = Names(prefix=args.run)
    except ValueError as exc:
        ap.error(str(exc))
    acl, files = write_acl(names, args.out)
    print(f"{prog}: wrote {acl} (load with: valkey-server --aclfile {acl}, or ACL LOAD)", file=sys.stderr)
    print(f"{prog}: wrote {acl.parent / 'nats-users.conf'} (NATS users: nats-server -c it, or `include` it)",
          file=sys.stderr)  # fmt: skip
    for role, path in files.items():
        print(f"  {names.prefix}-{role}: password in {path}  -> redis://{names.prefix}-{role}:<password>@HOST:6379/0",
              file=sys.stderr)  # fmt: skip
    return 0
