"""A real limit on a process's threads: a cgroup of its own whose ``pids.max`` the
test sets, as a container's is.

RLIMIT_NPROC (``prlimit --nproc``) is no such limit here: root ignores it, and for
any other user it counts every process of that user. A pids cgroup limits exactly
the processes and threads moved into it, whoever runs them. It needs a writable
pids hierarchy: cgroup v1's ``/sys/fs/cgroup/pids``, or cgroup v2 (the root of
``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``) with the pids controller.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _hierarchies() -> Iterator[Path]:
    yield _ROOT / "pids"  # cgroup v1
    for v2 in (_ROOT, _ROOT / "unified"):
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "pids" in controllers.read_text().split():
            yield v2


def _make_group() -> Path:
    """A new pids cgroup; OSError naming why none can be made."""
    errors = []
    for parent in _hierarchies():
        group = parent / f"snowflake-test-{uuid.uuid4().hex[:12]}"
        try:
            group.mkdir()
        except OSError as e:
            errors.append(f"{parent}: {e}")
            continue
        if not (group / "pids.max").exists():  # v2: the controller is not enabled below
            try:
                (parent / "cgroup.subtree_control").write_text("+pids")
            except OSError as e:
                group.rmdir()
                errors.append(f"{parent}: cannot enable the pids controller: {e}")
                continue
        return group
    raise OSError("; ".join(errors) or "no pids cgroup hierarchy is mounted")


def pids_limit_unavailable() -> str | None:
    """Why :func:`thread_limit` cannot work here, or None if it can."""
    try:
        group = _make_group()
    except OSError as e:
        return f"cannot make a pids cgroup (not root, or a read-only /sys/fs/cgroup): {e}"
    group.rmdir()
    return None


class PidsLimit:
    """The cgroup a process was moved into; its tasks may not grow past ``pids.max``."""

    def __init__(self, group: Path) -> None:
        self.group = group

    @property
    def current(self) -> int:
        return int((self.group / "pids.current").read_text())

    @property
    def maximum(self) -> int:
        return int((self.group / "pids.max").read_text())

    @property
    def refused(self) -> int:
        """Thread or process starts refused at the limit so far."""
        events = dict(
            line.split() for line in (self.group / "pids.events").read_text().splitlines()
        )
        return int(events.get("max", 0))


@contextmanager
def thread_limit(pid: int) -> Iterator[PidsLimit]:
    """Move process ``pid`` (all its threads) into a new pids cgroup whose limit is the
    tasks it has now: from then on it can start no thread. The group is removed at the
    end; the process must have exited by then (or it is moved back out first)."""
    group = _make_group()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        limit = PidsLimit(group)
        (group / "pids.max").write_text(str(limit.current))
        yield limit
    finally:
        (group / "pids.max").write_text("max")
        for task in (group / "cgroup.procs").read_text().split():
            # Back to the hierarchy's root: a cgroup holding a process cannot be removed.
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                (group.parent / "cgroup.procs").write_text(task)
        group.rmdir()
