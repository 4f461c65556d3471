"""The state file: the high-water mark of one (datacenter, worker) on this host.

The file holds a timestamp that no id issued by that worker here can exceed.
Writes are atomic (write a temporary file, fsync it, rename it over the old
one, fsync the directory), so a crash at any instant leaves either the old
mark or the new one, never a torn file. While a server runs it holds an
exclusive lock beside the file, so a second server with the same worker id
and the same state directory refuses to start (the host lock, ``hostlock``,
covers other state directories).

The file also records the id layout (epoch and field widths) the mark was
issued under: the mark is a wall-clock time, and the same time makes other
ids under another layout (a later epoch makes lower ids, repeats of old
ones), so a start under a layout other than the recorded one is refused.
Format 1 (0.1.0) had no layout: it is taken as written under the current
layout and rewritten as format 2 by the first write.

Format 3 is written for a layout with a clock sequence: it adds the mark of each
clock-sequence value (``high_water_marks_ms``) and the value in use
(``clock_sequence``); ``high_water_mark_ms`` is then the newest of the marks.
Without a clock sequence the file stays format 2, so that an older server can
still read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snowflake_thrift_client import Layout

from .._errors import StartupRefused
from .reservation import MarkStore, valid_marks

__all__ = [
    "LAYOUT_FIELDS",
    "STATE_FORMAT",
    "StateFile",
    "default_state_dir",
    "layout_fields",
    "layout_to_json",
    "valid_layout_json",
]

log = logging.getLogger(__name__)

STATE_FORMAT = 2
CLOCK_SEQUENCE_FORMAT = 3
_UNVERSIONED_LAYOUT = 1  # 0.1.0's format: no layout recorded

LAYOUT_FIELDS = ("epoch_ms", "timestamp_bits", "datacenter_id_bits", "worker_id_bits",
                 "sequence_bits", "clock_sequence_bits")  # fmt: skip
"""What the state file (and a mark in ZooKeeper) records of the layout, by ``Layout``'s
field names. ``clock_sequence_bits`` is recorded only when it is not 0, so that a
server from before it reads what a layout without one records."""


def layout_fields(layout: Layout) -> dict[str, int]:
    """Every field of the layout, by name (what ``get_layout`` and the HTTP API show)."""
    return {name: int(getattr(layout, name)) for name in LAYOUT_FIELDS}


def layout_to_json(layout: Layout) -> dict[str, int]:
    """The layout as the state file and ZooKeeper marks record it."""
    recorded = layout_fields(layout)
    if not layout.clock_sequence_bits:
        del recorded["clock_sequence_bits"]
    return recorded


def valid_layout_json(recorded: object) -> bool:
    """Whether ``recorded`` has the shape :func:`layout_to_json` gives."""
    return (
        isinstance(recorded, dict)
        and set(LAYOUT_FIELDS) - {"clock_sequence_bits"} <= set(recorded) <= set(LAYOUT_FIELDS)
        and all(type(value) is int for value in recorded.values())
    )


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{name} {layout.get(name, 0)!r}" for name in LAYOUT_FIELDS)


def default_state_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_STATE_HOME/snowflake``, else ``~/.local/state/snowflake``."""
    base = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME", "~")) / ".local/state")
    return Path(base).expanduser() / "snowflake"


class StateFile(MarkStore):
    """The high-water mark file of one worker, locked for this process.

    Open with :meth:`open`; :meth:`load` once; :meth:`advance` as the mark
    moves ahead; :meth:`finish` at shutdown; :meth:`close` to release the lock.
    """

    name = "disk"

    def __init__(self, path: Path, lock_fd: int, identity: dict[str, int], layout: Layout) -> None:
        super().__init__(-1, [-1] * (layout.max_clock_sequence + 1))
        self.path = path
        self._lock_fd = lock_fd
        self._identity = identity
        self._layout = layout_to_json(layout)

    @classmethod
    def open(
        cls, directory: Path, datacenter_id: int, worker_id: int, layout: Layout | None = None
    ) -> StateFile:
        """Lock the state of ``(datacenter_id, worker_id)`` in ``directory``; its ids
        are made under ``layout`` (Twitter's if not given).

        Raises ``StartupRefused`` if the directory cannot be used or another
        process holds the same worker in it.
        """
        name = f"worker-{datacenter_id}-{worker_id}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(directory / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StartupRefused(
                f"cannot use state directory {directory}: {e.strerror}; "
                "choose another with --state-dir"
            ) from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise StartupRefused(
                f"another process on this host is serving datacenter {datacenter_id}, "
                f"worker {worker_id} from this state directory (it holds "
                f"{directory / f'{name}.lock'}); two servers with one worker id would hand "
                "out the same ids"
            ) from None
        identity = {"datacenter_id": datacenter_id, "worker_id": worker_id}
        return cls(directory / f"{name}.json", lock_fd, identity, layout or Layout())

    def load(self, *, discard_corrupt: bool = False) -> int | None:
        """The newest stored mark in ms since the Unix epoch, or None on a first start;
        :attr:`marks` and :attr:`clock_sequence` then hold what the file says.

        A file that cannot be read or understood raises ``StartupRefused``:
        silently starting over could repeat ids. ``discard_corrupt`` treats
        such a file as absent (it is overwritten by the first renewal). A file
        written under another layout always raises ``StartupRefused``: it is
        not corrupt, and its mark means other ids under this layout.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            return self._corrupt(f"cannot read it: {e}", discard_corrupt)
        try:
            data: Any = json.loads(text)
            mark = data["high_water_mark_ms"]
            owner = {k: data.get(k) for k in self._identity}
            version = data.get("format")
            recorded = data["layout"] if version in (STATE_FORMAT, CLOCK_SEQUENCE_FORMAT) else None
            by_value = (
                data["high_water_marks_ms"]
                if version == CLOCK_SEQUENCE_FORMAT
                # Older formats had no clock sequence: their mark is value 0's.
                else [mark, *[-1] * (len(self._marks) - 1)]
            )
            value = data["clock_sequence"] if version == CLOCK_SEQUENCE_FORMAT else 0
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self._corrupt(f"not a state file ({type(e).__name__}: {e})", discard_corrupt)
        if version not in (CLOCK_SEQUENCE_FORMAT, STATE_FORMAT, _UNVERSIONED_LAYOUT):
            return self._corrupt(f"unknown format {version!r}", discard_corrupt)
        if owner != self._identity:
            return self._corrupt(f"it belongs to another worker: {owner}", discard_corrupt)
        if not isinstance(mark, int) or isinstance(mark, bool) or mark < 0:
            return self._corrupt(f"bad high_water_mark_ms {mark!r}", discard_corrupt)
        if not valid_marks(by_value, value, mark):
            return self._corrupt(
                f"bad clock-sequence marks {by_value!r} (in use: {value!r})", discard_corrupt
            )
        if recorded is None:
            log.warning(
                "state file %s records no id layout (format 1, from 0.1.0): taking its mark "
                "as made under the current layout (%s); the next write records it",
                self.path, _describe(self._layout),
            )  # fmt: skip
        elif not valid_layout_json(recorded):
            return self._corrupt(f"bad layout {recorded!r}", discard_corrupt)
        elif {"clock_sequence_bits": 0, **recorded} != {"clock_sequence_bits": 0, **self._layout}:
            raise StartupRefused(
                f"state file {self.path} was written under another id layout "
                f"({_describe(recorded)}) than this server's ({_describe(self._layout)}). "
                "The same time makes other ids under another layout (a later epoch makes "
                "lower ids, repeats of ids already issued). Start with the recorded layout "
                "again (--epoch and the --*-bits options), or serve the new layout under a "
                "new --worker-id or --datacenter-id. Only if the clock is surely past every "
                "id the old layout issued, move the state file away"
            )
        if len(by_value) != len(self._marks):  # the same layout: cannot differ, but check
            return self._corrupt(f"{len(by_value)} clock-sequence marks", discard_corrupt)
        self._marks, self._value = by_value, value
        return mark

    def _corrupt(self, why: str, discard: bool) -> int | None:
        """None (start as if first) if ``discard``; else refuse with what to do."""
        if discard:
            return None
        raise StartupRefused(
            f"state file {self.path} is unusable: {why}. It holds the newest timestamp this "
            "worker may have used; starting without it could repeat ids. Restore it, or if "
            "you are sure the clock is past every id this worker issued, start once with "
            "--discard-corrupt-state"
        )

    @property
    def where(self) -> str:
        return str(self.path)

    def _store(self, marks: tuple[int, ...], clock_sequence: int) -> None:
        record: dict[str, object] = {
            "format": STATE_FORMAT if len(marks) == 1 else CLOCK_SEQUENCE_FORMAT,
            **self._identity,
            "layout": self._layout,
            "high_water_mark_ms": max(marks),
        }
        if len(marks) > 1:
            record["clock_sequence"] = clock_sequence
            record["high_water_marks_ms"] = list(marks)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        """Release the lock: another process may take this worker now."""
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
