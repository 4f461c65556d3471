"""The snowflake command as an operator runs it: a process reading a pipe."""

from __future__ import annotations

import subprocess
import sys


def test_the_snowflake_command_decodes_a_pipe() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "snowflake_server._cli", "decode", "--epoch", "0",
         "--sequence-bits", "10"],
        input=b"1025\nbad\n", capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert done.stdout.decode().startswith("1025\n  time        1970-01-01T00:00:00.000Z (0 ms)\n")
    assert b"sequence    1\n" in done.stdout
    assert done.stderr == (
        b"snowflake decode: error: line 2 of standard input: 'bad' is not an id: not a plain "
        b"decimal integer (ASCII digits 0-9 only: no sign, space or _)\n"
    )
