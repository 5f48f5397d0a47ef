"""The processes of the benchmark jobs: never imported by the benchmark's own process.

Run as a script (fresh interpreter; the top of this file imports only the standard library,
so ``python -S _ranks.py sleeper`` starts in a few ms):

    _ranks.py sleeper READY KIND [--peerwatch] [--note-term]   a rank that sleeps
    _ranks.py idle READY [--peerwatch|--waker]                  a rank that sleeps, for CPU accounting
    _ranks.py train KIND [--peerwatch]                          a training loop driven from stdin

or forked from a template process (``_template.py``) that imported torch or Lightning:

    lightning_rank0(READY, WORLD)    Lightning-style rank 0 running Lightning's _ChildProcessObserver
    gloo_rank(READY)                 a rank in a gloo all_reduce loop (or blocked in store.wait)

READY is a folder; each process writes small notes there (atomically): ``rank-<i>`` (its pid)
once it is running, and the moments (time.time_ns()) the benchmark measures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NEVER_S = 3600.0


def note(folder: str, name: str, text: str) -> None:
    path = os.path.join(folder, name)
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def sleep_forever() -> None:
    while True:
        time.sleep(NEVER_S)


# -- fresh interpreters ----------------------------------------------------------------


def sleeper(ready: str, kind: str, use_peerwatch: bool, note_term: bool) -> None:
    """A rank that sleeps in Python until it is torn down.

    ``kind`` names it: ``lightning`` (a child of Lightning-style rank 0: ``rank-<LOCAL_RANK>``)
    or ``torchrun`` (a worker: ``w<restart>-<LOCAL_RANK>``, one set of names per attempt).
    With ``note_term`` a SIGTERM is noted (``term-<name>``: when the launcher told it to stop).
    """
    local_rank = os.environ["LOCAL_RANK"]
    if kind == "torchrun":
        name = f"w{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{local_rank}"
    else:
        name = f"rank-{local_rank}"
    if use_peerwatch:
        import peerwatch

        peerwatch.install()
    if note_term:
        def on_term(signum: int, frame: object) -> None:
            note(ready, f"term-{name}", str(time.time_ns()))
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
    note(ready, name, str(os.getpid()))
    sleep_forever()


def idle(ready: str, use_peerwatch: bool, waker: bool) -> None:
    """A rank that only sleeps: what is left of its CPU time is the watcher's. With ``waker``,
    the floor instead: one thread that only wakes once a second and writes a heartbeat-sized
    record in place (what no Python watcher waking once a second can go below)."""
    rank = os.environ["RANK"]
    t0 = time.perf_counter()
    import_s = install_s = 0.0
    if waker:
        import threading

        threading.Thread(target=_wake_once_a_second, args=(os.path.join(ready, f"beat-{rank}"),), daemon=True).start()
    if use_peerwatch:
        import peerwatch

        t1 = time.perf_counter()
        peerwatch.install()
        import_s, install_s = t1 - t0, time.perf_counter() - t1
    note(ready, f"rank-{rank}", json.dumps({"pid": os.getpid(), "import_s": import_s, "install_s": install_s}))
    sleep_forever()


def _wake_once_a_second(path: str) -> None:
    import select

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    record, poller = b" " * 357, select.poll()
    while True:
        poller.poll(1000)
        os.pwrite(fd, record, 0)


def _python_step(state: dict) -> None:
    """Python-heavy work: what a data pipeline or a logging callback does between kernels."""
    rows = [{"id": i, "text": f"token-{(i * 7919 + state['step']) % 1000}", "w": i % 13} for i in range(1500)]
    counts: dict = {}
    for row in rows:
        counts[row["text"]] = counts.get(row["text"], 0) + row["w"]
    state["acc"] = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    state["step"] += 1


def train(kind: str, use_peerwatch: bool) -> None:
    """A training loop that runs blocks of steps on request (stdin: ``run S`` or ``quit``).

    ``torch``: a small MLP under DistributedDataParallel (gloo, one thread), SGD.
    ``python``: a Python-heavy step (no torch). Replies one JSON line a block:
    ``{"mean_ms": ..., "cpu_ms": ...}``: wall time and process CPU time per step of the block.
    """
    if use_peerwatch:
        import peerwatch

        peerwatch.install()
    step = None
    if kind == "torch":
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        torch.manual_seed(dist.get_rank())
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        ))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def step() -> None:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
    else:
        state = {"step": 0, "acc": None}

        def step() -> None:
            _python_step(state)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        steps = int(cmd[1])
        step()  # not timed: the first step after a pause warms the caches again
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        mean_ms = (time.perf_counter() - t0) * 1000 / steps
        cpu_ms = (time.process_time() - c0) * 1000 / steps  # every thread: the watcher's too
        print(json.dumps({"mean_ms": mean_ms, "cpu_ms": cpu_ms}), flush=True)


# -- forked from a template ------------------------------------------------------------


def lightning_rank0(ready: str, world: int) -> None:
    """Rank 0 as Lightning's subprocess launcher makes it: it starts ranks 1..N-1 with
    Popen, then runs Lightning's own ``_ChildProcessObserver`` over them.

    The observer starts at the moment written in ``READY/observer-at`` (the benchmark
    staggers the observers of concurrent jobs). Its ``_terminate_all`` is wrapped only to
    note when it decided (``detected``); then the real one runs.
    """
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    procs = []
    for child_rank in range(1, world):
        env = dict(os.environ, LOCAL_RANK=str(child_rank))
        argv = [sys.executable, "-S", os.path.join(HERE, "_ranks.py"), "sleeper", ready, "lightning"]
        procs.append(subprocess.Popen(argv, env=env))
    note(ready, "rank-0", str(os.getpid()))
    at_path = os.path.join(ready, "observer-at")  # written atomically by the benchmark
    while not os.path.exists(at_path):
        time.sleep(0.005)
    with open(at_path) as f:
        at_ns = int(f.read())
    time.sleep(max(0.0, (at_ns - time.time_ns()) / 1e9))
    observer = _ChildProcessObserver(main_pid=os.getpid(), child_processes=procs)
    terminate_all = observer._terminate_all

    def noted_terminate_all() -> None:
        note(ready, "detected", str(time.time_ns()))
        terminate_all()

    observer._terminate_all = noted_terminate_all  # type: ignore[method-assign]
    observer.start()
    note(ready, "observer-started", str(time.time_ns()))
    sleep_forever()


def gloo_rank(ready: str) -> None:
    """A rank of a CPU training job: gloo all_reduce in a loop, 10 ms apart.

    ``BENCH_PEERWATCH=1``: peerwatch.install() first. ``BENCH_CAP_S``: the process group's
    timeout. ``BENCH_BLOCK=store``: once running, wait in the TCPStore for a key nobody
    sets (as with NCCL, a dead peer is invisible there). The first error a rank sees is
    noted (``error-<rank>``), then raised.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if os.environ.get("BENCH_PEERWATCH") == "1":
        import peerwatch

        peerwatch.install()
    cap = datetime.timedelta(seconds=float(os.environ["BENCH_CAP_S"]))
    t = torch.ones(4)
    try:
        dist.init_process_group("gloo", timeout=cap)
        for step in range(10**9):
            dist.all_reduce(t)
            if step == 3:
                note(ready, f"rank-{rank}", str(os.getpid()))
                if os.environ.get("BENCH_BLOCK") == "store":
                    dist.distributed_c10d._get_default_store().wait(["set-by-nobody"], cap)
            time.sleep(0.01)
    except Exception:
        note(ready, f"error-{rank}", str(time.time_ns()))
        raise


def main() -> None:
    what, rest = sys.argv[1], sys.argv[2:]
    flags = {a for a in rest if a.startswith("--")}
    args = [a for a in rest if not a.startswith("--")]
    if what == "sleeper":
        sleeper(args[0], args[1], "--peerwatch" in flags, "--note-term" in flags)
    elif what == "idle":
        idle(args[0], "--peerwatch" in flags, "--waker" in flags)
    elif what == "train":
        train(args[0], "--peerwatch" in flags)
    else:
        raise SystemExit(f"unknown program {what!r}")


if __name__ == "__main__":
    main()
