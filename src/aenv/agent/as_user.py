"""``python -m aenv.agent.as_user USER CWD ARGV...``: exec ``ARGV`` as ``USER`` in ``CWD``.

A template's start command runs as the user and in the directory its build left (E2B's and Docker's
rule: the last USER and WORKDIR). The agent starts it through this small program rather than forking
itself: it is PID 1 and reaps with ``waitpid(-1)``, so it only ever ``posix_spawn``s. An empty USER or
CWD keeps the agent's (root, ``/``)."""

from __future__ import annotations

import os
import pwd
import sys


def switch(user: str, cwd: str) -> None:
    if cwd:
        os.chdir(cwd)
    if not user:
        return
    name, _, group = user.partition(":")
    entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    gid = int(group) if group.isdigit() else entry.pw_gid
    os.initgroups(entry.pw_name, gid)
    os.setgid(gid)
    os.setuid(entry.pw_uid)
    os.environ.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m aenv.agent.as_user USER CWD ARGV...", file=sys.stderr)
        return 2
    user, cwd, command = argv[0], argv[1], argv[2:]
    try:
        switch(user, cwd)
        os.execvp(command[0], command)
    except (OSError, KeyError, ValueError) as exc:
        print(f"start command: cannot run as {user or 'root'} in {cwd or '/'}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
