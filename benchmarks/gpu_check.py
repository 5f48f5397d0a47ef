"""What only a GPU can show: run on a machine with one (or more) CUDA GPUs.

    .venv/bin/python benchmarks/gpu_check.py [--json OUT.json]

1. **NCCL through the flight recorder.** A one-rank NCCL group (one GPU cannot hold two
   NCCL ranks: NCCL refuses two ranks on one device) under ``peerwatch.install()``: a few
   ``all_reduce`` on the GPU, then peerwatch's own reader (``_dump_nccl_trace_json`` and
   ``_dump_fr_trace_json``) must see the counters move and name the op, and peerwatch's
   flight-recorder dump (``RUN/flight_recorder``) must be written in torch's format.
2. **CUDA-holding ranks killed, memory back.** ``peerwatch doctor --json``: on one GPU its
   self-test runs 4 ranks that each hold 256 MiB of GPU memory, SIGKILLs one, and checks
   the teardown and that the memory comes back (on 2+ GPUs, over NCCL).
3. **The doctor's GPU paths**: its ``gpus`` and ``torch`` checks, as printed.

Exit status 0 when every check passed, 1 when one failed, 2 when there is no GPU here
(nothing checked: CI never has one; nothing in the test suite depends on this script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import clean_env, free_port, machine, peerwatch_commit  # noqa: E402

NCCL_RANK = r"""
import json, os, sys, time
import peerwatch
handle = peerwatch.install()
import torch, torch.distributed as dist
from peerwatch.hangs.collectives import CollectiveReader
from peerwatch.hangs.frdump import FlightRecorderDump
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(1 << 20, device="cuda")
for _ in range(5):
    dist.all_reduce(t)
torch.cuda.synchronize()
out = {"nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}
reader = CollectiveReader(0)
deadline = time.monotonic() + 10
counters = reader.counters()
while not counters and time.monotonic() < deadline:
    time.sleep(0.1)
    counters = reader.counters()
out["state"] = reader.state
out["counters"] = [list(c) for c in counters or ()]
out["entered"] = [list(e) for e in reader.entered(counters or (), 3)]
out["dumps"] = [getattr(d, "__name__", str(d)) for d in reader._dumps or ()]
t0 = time.perf_counter()
written = FlightRecorderDump(handle._w.run_dir, 0).dump("gpu-check")  # as the watcher does at a diagnosis
out["dump_s"] = time.perf_counter() - t0
out["dump_written"] = written
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def gpus() -> List[str]:
    out = subprocess.run([sys.executable, "-c", "import torch; print('\\n'.join(torch.cuda.get_device_name(i) "
                          "for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else '')"],
                         capture_output=True, text=True, timeout=300)
    return [line for line in out.stdout.splitlines() if line.strip()]


def nccl_one_rank(tmp: str) -> Dict[str, Any]:
    run = os.path.join(tmp, "run")
    env = clean_env(PEERWATCH_DIR=run, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), PYTHONPATH=ROOT, PEERWATCH_HEARTBEAT="0.2")
    proc = subprocess.run([sys.executable, "-c", NCCL_RANK], env=env, capture_output=True, text=True, timeout=300)
    result: Dict[str, Any] = {"returncode": proc.returncode}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[7:]))
    folder = os.path.join(run, "flight_recorder")
    result["dump_files"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if proc.returncode != 0 or "counters" not in result:
        result["log"] = (proc.stdout + proc.stderr)[-3000:]
    moved = any(enqueued >= 5 for _, enqueued, _ in result.get("counters", []))
    named = any("allreduce" in str(e[2]).lower() or "all_reduce" in str(e[2]).lower() for e in result.get("entered", []))
    result["ok"] = proc.returncode == 0 and moved and named
    return result


def doctor() -> Dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "peerwatch", "doctor", "--json"], capture_output=True, text=True,
                          timeout=600, env=clean_env(PYTHONPATH=ROOT))
    try:
        body = json.loads(proc.stdout)
    except ValueError:
        body = {"raw": proc.stdout[-3000:], "stderr": proc.stderr[-3000:]}
    return {"returncode": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "body": body,
            "ok": proc.returncode == 0}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write every result here too")
    args = parser.parse_args()
    print(f"peerwatch {peerwatch_commit()}, {machine()}, {time.strftime('%Y-%m-%d %H:%M')}\n", flush=True)
    found = gpus()
    if not found:
        print("no CUDA GPU visible to torch here: nothing checked")
        return 2
    print(f"GPUs: {', '.join(found)}\n", flush=True)
    results: Dict[str, Any] = {"gpus": found}
    with tempfile.TemporaryDirectory() as tmp:
        results["nccl_one_rank"] = nccl_one_rank(tmp)
    print("1. one-rank NCCL group, read by peerwatch:", json.dumps(results["nccl_one_rank"], indent=1), flush=True)
    results["doctor"] = doctor()
    print("2-3. peerwatch doctor --json:", json.dumps(results["doctor"], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r.get("ok") for r in (results["nccl_one_rank"], results["doctor"]))
    print("\nresult:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
