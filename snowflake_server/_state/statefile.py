"""The state file: the high-water mark of one (datacenter, worker) on this host.

The file holds a timestamp that no id issued by that worker here can exceed.
Writes are atomic (write a temporary file whole, fsync it, rename it over the
old one, fsync the directory), so a crash at any instant leaves either the old
mark or the new one, never a torn file; a write that cannot store every byte
(a full disk, a file-size limit: ``EFBIG``, ``ENOSPC``, ``EIO``) raises and
leaves the old file as it was. While a server runs it holds an exclusive lock
beside the file, so a second server with the same worker id and the same state
directory refuses to start (the host lock, ``hostlock``, covers other state
directories).

The state directory must be the server's own (:func:`open_state_dir`): a real
directory, not a link, that no other user can write to. Every file in it is
opened relative to the directory opened once at start, and never through a
link, so nothing planted there (a ``.tmp`` link to another file) is written
through.

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
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snowflake_thrift_client import Layout

from .._errors import ConfigurationError, StartupRefused
from .._ids.layouts import describe_layout_json, layout_to_json, valid_layout_json
from .reservation import MarkStore, valid_marks

__all__ = [
    "STATE_FORMAT",
    "StateFile",
    "check_state_dir",
    "open_state_dir",
    "write_whole",
]

log = logging.getLogger(__name__)

STATE_FORMAT = 2
CLOCK_SEQUENCE_FORMAT = 3
_UNVERSIONED_LAYOUT = 1  # 0.1.0's format: no layout recorded

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted as the state file must not hang the start.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# O_EXCL: never an existing file, link or not; O_NOFOLLOW says so once more.
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _whoami() -> str:
    return f"uid {os.geteuid()}, gid {os.getegid()}"


def _describe_dir(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, group gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"


def open_state_dir(directory: Path) -> int:
    """Open the state directory (created, mode 0700, if missing) for the files in it:
    a descriptor that every later open, rename and fsync is relative to.

    Raises ``ConfigurationError`` naming the path, what is wrong and the fix if the
    directory cannot be the server's own: a symbolic link, something that is not a
    directory, a directory this server may not use, or one another user can write to
    (see :func:`check_state_dir`).
    """
    try:
        try:
            fd = os.open(directory, _DIR_FLAGS)
        except FileNotFoundError:
            # The umask can only narrow 0700; missing parents get the usual mode.
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        raise _unusable_dir(directory, e) from None
    try:
        check_state_dir(directory, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_state_dir(directory: Path, st: os.stat_result) -> None:
    """Raise ``ConfigurationError`` unless only this server's user and groups (and root)
    can write to the directory ``st`` describes.

    Refused: writable by every user (with the sticky bit too, as ``/tmp``: others
    could create the names the server uses before it does); owned by a user other
    than this server's or root (its owner can always change its mode); writable by
    a group this server's user is not in. Accepted: owned by this user, or by root
    and group-owned by one of this user's groups (a Kubernetes volume under
    ``fsGroup``: root, the pod's group, mode 2775). The parents are not checked:
    the directory is opened once and every file in it relative to that, so a parent
    changed later cannot redirect a write (at worst the directory is moved away: a
    lost state, which ``--first-start-wait`` covers).
    """
    uid = os.geteuid()
    groups = {os.getegid(), *os.getgroups()}
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        problem = "every user may write to it"
        fix = f"chmod o-w {directory}"
    elif st.st_uid not in (uid, 0):
        problem = f"it belongs to another user (uid {st.st_uid})"
        fix = f"chown {uid} {directory}"
    elif mode & stat.S_IWGRP and st.st_gid not in groups:
        problem = f"group {st.st_gid} may write to it and this server's user is not in it"
        fix = f"chmod g-w {directory} (or chgrp {os.getegid()} {directory})"
    else:
        return
    raise ConfigurationError(
        f"state directory {directory} is not this server's own: {problem} "
        f"({_describe_dir(st)}; this server runs as {_whoami()}). Another user could "
        "plant files in it (a link this server would write through, a state file of "
        f"their making). Fix: {fix}, or choose another --state-dir (a missing one is "
        "created, mode 0700)"
    )


def _linked_dir(directory: Path) -> ConfigurationError:
    return ConfigurationError(
        f"state directory {directory} is a symbolic link: the server keeps its state only "
        "in a directory of its own, not through a link another user might point "
        f"elsewhere. Give --state-dir the directory itself ({os.path.realpath(directory)})"
    )


def _unusable_dir(directory: Path, e: OSError) -> ConfigurationError:
    # O_NOFOLLOW met a link: ENOTDIR with O_DIRECTORY (Linux), ELOOP without.
    if e.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(directory):
        return _linked_dir(directory)
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        fix = (
            f"a file is where a directory should be (at {directory} or in its path): move "
            "it away, or choose another --state-dir"
        )
    else:
        fix = _permission_fix(directory, e) or "choose another --state-dir"
    return ConfigurationError(f"cannot use state directory {directory}: {e.strerror}; {fix}")


def _permission_fix(directory: Path, e: OSError) -> str | None:
    if e.errno not in (errno.EACCES, errno.EPERM):
        return None
    try:
        ours = os.stat(directory).st_uid == os.geteuid()
    except OSError:  # missing, or its parent may not be searched: give it one of its own
        ours = False
    give = (
        f"chmod u+rwx {directory}"  # ours already: its mode keeps us out
        if ours
        else f"chown {os.geteuid()}:{os.getegid()} {directory}"
    )
    return (
        f"this server's user ({_whoami()}) may not create or use it: give it the "
        f"directory ({give}), or choose another --state-dir"
    )


def write_whole(fd: int, data: bytes, write: Callable[[int, memoryview], int] = os.write) -> None:
    """Write every byte of ``data`` to ``fd``, or raise ``OSError``.

    ``os.write`` may store fewer bytes than given (a file-size limit, a full disk:
    the next write then fails with ``EFBIG`` or ``ENOSPC``); a write that stores
    nothing raises ``EIO`` rather than loop.
    """
    view = memoryview(data)
    while view:
        written = write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, f"a write stored nothing, {len(view)} bytes left")
        view = view[written:]


class StateFile(MarkStore):
    """The high-water mark file of one worker, locked for this process.

    Open with :meth:`open`; :meth:`load` once; :meth:`advance` as the mark
    moves ahead; :meth:`finish` at shutdown; :meth:`close` to release the lock.
    """

    name = "disk"

    writer: Callable[[int, memoryview], int] = staticmethod(os.write)
    """How bytes reach the temporary file (``os.write``; a test injects short writes)."""

    def __init__(
        self, path: Path, dir_fd: int, lock_fd: int, identity: dict[str, int], layout: Layout
    ) -> None:
        super().__init__(-1, [-1] * (layout.max_clock_sequence + 1))
        self.path = path
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd
        self._identity = identity
        self._layout = layout_to_json(layout)

    @classmethod
    def open(
        cls, directory: Path, datacenter_id: int, worker_id: int, layout: Layout | None = None
    ) -> StateFile:
        """Lock the state of ``(datacenter_id, worker_id)`` in ``directory``; its ids
        are made under ``layout`` (Twitter's if not given).

        Raises ``ConfigurationError`` if the directory cannot be the server's own
        (:func:`open_state_dir`) or its lock file cannot be opened, ``StartupRefused``
        if another process holds the same worker in it.
        """
        name = f"worker-{datacenter_id}-{worker_id}"
        dir_fd = open_state_dir(directory)
        try:
            lock_fd = _open_lock(dir_fd, directory / f"{name}.lock")
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(lock_fd)
                raise StartupRefused(
                    f"another process on this host is serving datacenter {datacenter_id}, "
                    f"worker {worker_id} from this state directory (it holds "
                    f"{directory / f'{name}.lock'}); two servers with one worker id would "
                    "hand out the same ids"
                ) from None
        except BaseException:
            os.close(dir_fd)
            raise
        identity = {"datacenter_id": datacenter_id, "worker_id": worker_id}
        return cls(directory / f"{name}.json", dir_fd, lock_fd, identity, layout or Layout())

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
            fd = os.open(self.path.name, _READ_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._linked() from None
            if e.errno in (errno.EACCES, errno.EPERM):
                # A permission is a setting to fix, never a reason to discard the mark.
                raise ConfigurationError(
                    f"state file {self.path}: {e.strerror}: this server's user "
                    f"({_whoami()}) may not read it; give it the file (chown "
                    f"{os.geteuid()}:{os.getegid()} {self.path})"
                ) from None
            return self._corrupt(f"cannot read it: {e.strerror}", discard_corrupt)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, a FIFO
                return self._corrupt("not a regular file", discard_corrupt)
            with open(fd, "rb", closefd=False) as file:
                text = file.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            return self._corrupt(f"cannot read it: {e}", discard_corrupt)
        finally:
            os.close(fd)
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
                self.path, describe_layout_json(self._layout),
            )  # fmt: skip
        elif not valid_layout_json(recorded):
            return self._corrupt(f"bad layout {recorded!r}", discard_corrupt)
        elif {"clock_sequence_bits": 0, **recorded} != {"clock_sequence_bits": 0, **self._layout}:
            raise StartupRefused(
                f"state file {self.path} was written under another id layout "
                f"({describe_layout_json(recorded)}) than this server's "
                f"({describe_layout_json(self._layout)}). "
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

    def _linked(self) -> ConfigurationError:
        """A state file that is a symbolic link: refused, whatever it points to."""
        try:
            target = os.readlink(self.path.name, dir_fd=self._dir_fd)
        except OSError as e:  # gone or replaced meanwhile
            target = f"unreadable: {e.strerror}"
        return ConfigurationError(
            f"state file {self.path} is a symbolic link (to {target}): the server reads and "
            "writes its state only as a file of its own in the state directory, never "
            "through a link (a planted one would make it overwrite another file). Replace "
            "the link by a copy of the file it points to (cp --remove-destination "
            f'"$(readlink -f {self.path})" {self.path}), or remove it if it points nowhere'
        )

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
        data = (json.dumps(record) + "\n").encode()
        tmp = self.path.name + ".tmp"
        # A stale one (a crash mid-write) or anything planted: unlink removes a link, not
        # what it points to; O_EXCL then fails rather than open what reappeared since.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=self._dir_fd)
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o644, dir_fd=self._dir_fd)
            try:
                write_whole(fd, data, self.writer)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            # Never renamed: the state file keeps the last mark stored, whole.
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            raise OSError(
                e.errno, f"{e.strerror} (writing {self.path}.tmp; the state file is unchanged)"
            ) from e
        os.replace(tmp, self.path.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        os.fsync(self._dir_fd)  # the rename itself must survive a crash

    def close(self) -> None:
        """Release the lock: another process may take this worker now."""
        for fd in (self._lock_fd, self._dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _open_lock(dir_fd: int, path: Path) -> int:
    """The lock file of one worker in the state directory, opened (created if missing)
    never through a link. Raises ``ConfigurationError`` if it cannot be."""
    remove = f"It holds nothing: remove it (rm -r {path}) and the server creates its own"
    try:
        fd = os.open(path.name, _LOCK_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigurationError(
                f"lock file {path} is a symbolic link: the server never opens its files "
                f"through one. {remove}"
            ) from None
        fix = _permission_fix(path.parent, e) or remove
        raise ConfigurationError(f"cannot open lock file {path}: {e.strerror}; {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigurationError(f"lock file {path} is not a regular file. {remove}")
    return fd
