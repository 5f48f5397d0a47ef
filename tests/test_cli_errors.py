"""The CLI's errors say the truth, with the usage of the command that was given.

- ``peerwatch status FILE``: a file is not a directory (before, as root, which may read any
  file but cannot search one with no x bit: "cannot be read by this user");
- ``peerwatch ls --base DIR`` where DIR does not exist, or is no directory: said, exit 2
  (before: "no run directories in DIR", exit 0, as for an empty folder);
- a bad argument to a subcommand prints that subcommand's usage, which names its options
  (before: the top-level usage, for an unknown option and for ``--interval 0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT_S = 60.0


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "peerwatch", *args], env=env, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["status", "report"])
def test_a_file_is_said_to_be_no_directory(tmp_path: Path, command: str, no_leaks: str) -> None:
    readable = tmp_path / "passwd"
    readable.write_text("root:x:0:0::/root:/bin/sh\n")
    readable.chmod(0o644)
    for path in (str(readable), "/etc/passwd"):
        result = cli(command, path)
        assert result.returncode == 2, result
        assert result.stderr == f"peerwatch: run directory {path}: is not a directory, so not a peerwatch run directory\n"
        assert result.stdout == ""


@pytest.mark.timeout(60)
def test_ls_of_a_base_that_does_not_exist_says_so_and_fails(tmp_path: Path, no_leaks: str) -> None:
    missing = tmp_path / "nonexistent"
    result = cli("ls", "--base", str(missing))
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr == f"peerwatch: ls: {missing} does not exist\n"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    result = cli("ls", "--base", str(a_file))
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr == f"peerwatch: ls: {a_file} cannot be listed: Not a directory\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("ls", "--base", str(empty))  # a base that is there and empty is no error
    assert (result.returncode, result.stdout) == (0, f"no run directories in {empty}\n"), result


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "error"), [
    (("status", "--bogus"), "unrecognized arguments: --bogus"),
    (("status", "--interval", "0"), "argument --interval: must be above 0 and finite, not 0"),
    (("status", "--interval", "x"), "argument --interval: invalid float value: 'x'"),
    (("report", "a", "b"), "unrecognized arguments: b"),
    (("ls", "--json"), "unrecognized arguments: --json"),
    (("gc", "--force"), "unrecognized arguments: --force"),
    (("doctor", "extra"), "unrecognized arguments: extra"),
])
def test_a_subcommand_error_prints_that_subcommands_usage(args: tuple, error: str, no_leaks: str) -> None:
    result = cli(*args)
    assert (result.returncode, result.stdout) == (2, ""), result
    usage, said = result.stderr.splitlines()[0], result.stderr.splitlines()[-1]
    assert usage.startswith(f"usage: peerwatch {args[0]} [-h]"), result.stderr
    assert said == f"peerwatch {args[0]}: error: {error}", result.stderr


@pytest.mark.timeout(60)
def test_an_error_before_the_subcommand_is_the_top_level_ones(no_leaks: str) -> None:
    result = cli("--bogus", "status")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: peerwatch [-h] [--version]"), result.stderr
    assert result.stderr.splitlines()[-1] == "peerwatch: error: unrecognized arguments: --bogus"
