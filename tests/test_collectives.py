"""Reading torch's collective counters (peerwatch.hangs.collectives) with the real torch, in a
child process (a one-rank gloo group): what they say, that torch is never imported by
peerwatch, and one log line where the flight recorder is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(120)


def run(code: str, prefix: str = "") -> dict:
    program = prefix + textwrap.dedent(code)
    if prefix is GROUP:
        # Left to the interpreter's exit, gloo's threads were once destroyed still running:
        # "terminate called without an active exception", SIGABRT after the right output
        # (a fresh-clone run with two burners).
        program += "\nsys.stdout.flush()\ndist.destroy_process_group()\n"
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


GROUP = """
import datetime, json, logging, os, sys, tempfile
import peerwatch.hangs.collectives as c
lines = []
class Keep(logging.Handler):
    def emit(self, record): lines.append(record.getMessage())
logging.getLogger("peerwatch").addHandler(Keep())
reader = c.CollectiveReader(0)
before = reader.counters()
import torch, torch.distributed as dist
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=42))
"""


def test_the_counters_and_the_last_collectives_entered_of_a_real_group() -> None:
    got = run(prefix=GROUP, code="""
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2, dtype=torch.int64), 0)
    counters = reader.counters()
    entered = reader.entered(counters, 3)
    print(json.dumps({"before": before, "counters": counters, "entered": entered, "timeout_ms": reader.timeout_ms,
                      "lines": lines}))
    """)
    assert got["before"] is None  # torch.distributed not imported yet: not read, not imported
    # gloo marks a collective completed lazily (the last one may still read as not): the
    # diagnosis goes by the enqueued count alone.
    [(group, enqueued, completed)] = got["counters"]
    assert (group, enqueued) == ("0", 4) and completed in (3, 4), got
    assert got["entered"] == [["0", 2, "gloo:all_reduce", "[[4]] Float"], ["0", 3, "gloo:all_reduce", "[[4]] Float"],
                              ["0", 4, "gloo:broadcast", "[[2]] Long"]]
    assert got["timeout_ms"] == {"0": 42_000}
    assert got["lines"] == []


def test_a_torch_without_the_flight_recorder_is_said_once_and_read_as_nothing() -> None:
    got = run(prefix=GROUP, code="""
    del sys.modules["torch._C._distributed_c10d"]._dump_fr_trace_json  # as in a torch without it
    print(json.dumps({"reads": [reader.counters() for _ in range(3)], "lines": lines}))
    """)
    assert got["reads"] == [None, None, None]
    assert len(got["lines"]) == 1 and "no flight recorder" in got["lines"][0], got["lines"]
    assert "hang_timeout and peerwatch.beat()" in got["lines"][0]


def test_peerwatch_never_imports_torch_to_read_counters() -> None:
    got = run("""
    import json, sys
    import peerwatch, peerwatch.hangs.collectives as c
    peerwatch.install(run_dir=__import__("tempfile").mkdtemp() + "/run")
    r = c.CollectiveReader(0)
    print(json.dumps({"read": r.counters(), "torch": "torch" in sys.modules}))
    """)
    assert got == {"read": None, "torch": False}
