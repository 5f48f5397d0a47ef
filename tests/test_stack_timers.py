"""The faulthandler timers of a rank's stack file (issue 25.2): arming and cancelling are
one step with what they decide on, whichever threads call them. Before, Watcher.stop()
checked "no verdict yet" and then cancelled: the watcher thread could arm the teardown's
last resort in between, and have it cancelled (the rank was then not sure to exit), or
arm the GIL watchdog right after the stop (a finished rank ended by it in a slow exit).

Each case runs in a child process of its own: faulthandler's timer ends the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TIMER_S = 0.2
WATCH_S = 1.5  # how long a child lives on when no timer ends it: the window the timer had, several times over
PROGRAM = """
import sys, threading, time
from peerwatch.rundir.stacks import StackFile

stacks = StackFile(open(sys.argv[1], "w"))
{body}
time.sleep({watch})
print("lived", flush=True)
"""


def _run(tmp_path: Path, body: str) -> "tuple[int, str, str]":
    stack_file = tmp_path / "stacks.txt"
    program = PROGRAM.format(body=textwrap.dedent(body), watch=WATCH_S)
    done = subprocess.run([sys.executable, "-c", program, str(stack_file)], capture_output=True, text=True,
                          timeout=30)
    return done.returncode, done.stdout, stack_file.read_text()


def test_the_last_resort_is_not_cancelled_by_a_stop_that_comes_after(tmp_path: Path) -> None:
    code, out, dump = _run(tmp_path, f"stacks.arm_last_resort({TIMER_S}); stacks.cancel_timer()")
    assert (code, out) == (1, ""), "the teardown's last resort was cancelled"  # faulthandler's exit=True: _exit(1)
    assert "Timeout (0:00:00.2" in dump, dump


def test_no_gil_watchdog_is_armed_after_the_stop(tmp_path: Path) -> None:
    code, out, dump = _run(tmp_path, f"stacks.cancel_timer(); stacks.arm_gil_watchdog({TIMER_S})")
    assert (code, out) == (0, "lived\n"), f"a stopped rank was ended by its GIL watchdog:\n{dump}"


def test_a_teardown_after_the_stop_still_has_its_last_resort(tmp_path: Path) -> None:
    """Once a teardown has begun, the rank exits, stopped or not (rule: the last resort)."""
    code, out, _ = _run(tmp_path, f"stacks.cancel_timer(); stacks.arm_last_resort({TIMER_S})")
    assert (code, out) == (1, "")


def test_the_gil_watchdog_does_not_replace_the_last_resort(tmp_path: Path) -> None:
    """A heartbeat's re-arm racing the teardown must not put back the short GIL budget
    (nor, with a long one, push the last resort out)."""
    code, out, dump = _run(tmp_path, f"stacks.arm_last_resort({TIMER_S}); stacks.arm_gil_watchdog(60)")
    assert (code, out) == (1, ""), "the GIL watchdog's re-arm replaced the last resort"
    assert "Timeout (0:00:00.2" in dump, dump


def test_stop_and_teardown_from_two_threads_end_the_process(tmp_path: Path) -> None:
    """Watcher.stop() in the training thread, the teardown in the watcher thread, at once."""
    body = f"""
    go = threading.Barrier(2)
    def stop(): go.wait(); stacks.cancel_timer()
    def tear_down(): go.wait(); stacks.arm_last_resort({TIMER_S})
    threads = [threading.Thread(target=stop), threading.Thread(target=tear_down)]
    [t.start() for t in threads]; [t.join() for t in threads]
    """
    code, out, _ = _run(tmp_path, body)
    assert (code, out) == (1, "")
