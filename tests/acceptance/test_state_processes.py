"""The state file and the host lock between real processes: a lock held by another
process, a writer killed at any instant."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from snowflake_server import StartupRefused
from snowflake_server._state.hostlock import HostLock
from snowflake_server._state.statefile import StateFile
from tests.support.endpoints import unique_scope

_HOLDER = textwrap.dedent(
    """
    import sys
    from snowflake_server._state.hostlock import HostLock
    lock = HostLock.acquire(0, 5, sys.argv[1])
    print("held", flush=True)
    sys.stdin.read()
    """
)


def test_another_process_holds_it_until_it_dies() -> None:
    """The case the state file's lock missed: nothing on disk is shared."""
    scope = unique_scope()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, scope],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StartupRefused, match="serving datacenter 0, worker 5"):
            HostLock.acquire(0, 5, scope)
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel frees the name
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    HostLock.acquire(0, 5, scope).release()


_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from snowflake_server._state.statefile import StateFile
    state = StateFile.open(Path(sys.argv[1]), 0, 0)
    mark = 0
    while True:
        mark += 1
        state.advance(mark)
        print(mark, flush=True)
    """
)


@pytest.mark.slow  # 15 real processes killed mid-write
def test_a_crash_at_any_instant_leaves_a_whole_file(tmp_path: Path) -> None:
    for round_ in range(15):
        directory = tmp_path / str(round_)
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None
        confirmed = 0
        for line in writer.stdout:  # a varying number of writes before the kill
            confirmed = int(line)
            if confirmed >= 5 + round_ * 7:
                break
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        state = StateFile.open(directory, 0, 0)
        stored = state.load()  # must parse: never torn
        state.close()
        assert stored is not None and stored >= confirmed
