"""Training programs run by tests/test_launchers.py and benchmarks/launchers.py under
real launchers (Lightning, torchrun, torch.multiprocessing.spawn, ranks started by hand).

    python launcher_program.py lightning [--callback]   Trainer(strategy="ddp", accelerator="cpu")
    python launcher_program.py worker                    a gloo rank (torchrun, or started by hand)
    python launcher_program.py ddp                       a gloo rank training a DistributedDataParallel model (torchrun)
    python launcher_program.py spawn [--install-in-parent]   mp.spawn of LP_WORLD workers
    python launcher_program.py accelerate                Accelerator(cpu=True), under ``accelerate launch``
    python launcher_program.py deepspeed                 deepspeed.initialize on CPU (gloo), under ``deepspeed``

Environment:
    LP_READY       folder: each rank writes ``rank-<i>`` (its pid) once it is training
    LP_WORLD       number of ranks (lightning, spawn; default 2)
    LP_PEERWATCH   0: do not install peerwatch (the "without" runs of the benchmark)
    LP_WORKER_INSTALL  spawn: 0: the workers do not install peerwatch (with --install-in-parent: the parent only)
    LP_INSTALL_AT_TOP  1: peerwatch.install() at the top of this script, when it is imported (spawn: the
                   workers import it again, as ``__mp_main__``, before their function runs)
    LP_BLOCK       ``allreduce`` (default) or ``store`` (after READY, survivors wait in the
                   store for a key nobody sets: like NCCL, nothing notices a dead peer)
    LP_CRASH_RANK  worker: this rank raises before init_process_group, once every other
                   rank has written READY and is waiting in the rendezvous (it notes
                   ``crashed-at``: time.monotonic() right before it raises)
    LP_STEPS       steps to train (default: until killed); after a torchrun restart: 10
    LP_TERM_HANDLER  worker: 1: catch SIGTERM and go on (to save a checkpoint later)
    LP_FAIL_RANK   lightning, worker, accelerate, deepspeed: this rank fails once every rank is READY (worker:
                   mid-training, while the others wait for it in all_reduce)
    LP_FAIL_HOW    how it fails: ``raise`` (default: RuntimeError), ``os_exit`` (os._exit(3)),
                   ``raise_exit`` (``raise SystemExit(3)``, which reaches the top of the program) or
                   ``loop`` (an endless Python loop: the others wait for it in their collective)
    LP_TIMEOUT_S   the collectives' timeout (default: 5 minutes, beyond any test)
    LP_CLEANUP_S   lightning: then it takes this long to leave (a ``finally:`` block)
    LP_OBSERVER_PERIOD  lightning: seconds between looks of Lightning's _ChildProcessObserver (5)
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

STEP_S = 0.02  # pause per training step: the job stays mid-training, at little CPU cost
READY_AT_STEP = 3
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("LP_TIMEOUT_S", "300")))  # collectives and rendezvous


def peerwatch_on() -> bool:
    return os.environ.get("LP_PEERWATCH", "1") == "1"


if os.environ.get("LP_INSTALL_AT_TOP") == "1" and peerwatch_on():
    import peerwatch

    peerwatch.install()  # the README's one line, at the top of the script


def steps() -> int:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return 10  # a torchrun restart: finish, so that torchrun exits 0
    return int(os.environ.get("LP_STEPS", "0")) or 10**9


def note(name: str, text: str) -> None:
    folder = os.environ.get("LP_READY")
    if folder:
        path = os.path.join(folder, name)
        tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers never share it
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def ready(rank: int) -> None:
    note(f"rank-{rank}", str(os.getpid()))


def count_ready() -> int:
    folder = os.environ.get("LP_READY", "")
    return sum(1 for name in os.listdir(folder) if name.startswith("rank-") and not name.endswith(".tmp")) if folder else 0


# -- torchrun / by hand -------------------------------------------------------------


def worker() -> None:
    if os.environ.get("LP_TERM_HANDLER") == "1":
        # Many training scripts catch SIGTERM to save a checkpoint at the next step and
        # go on meanwhile; a rank blocked in a collective never gets to that step.
        signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM: will save at the next step", flush=True))
    if peerwatch_on():
        import peerwatch

        peerwatch.install()
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    crash = int(os.environ.get("LP_CRASH_RANK", "-1"))
    if rank == crash:
        ready(rank)
        deadline = time.monotonic() + 60
        while count_ready() < world and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the others are inside init_process_group by now
        note("crashed-at", repr(time.monotonic()))  # CLOCK_MONOTONIC: the test's clock too
        raise RuntimeError(f"rank {rank} crashed before init_process_group")
    if crash >= 0:
        ready(rank)  # about to wait in the rendezvous for the rank that will crash
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps its store across restarts, and gloo would read the addresses of
        # the previous attempt's ranks from it (connectFullMesh: connection refused).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=TIMEOUT)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"launcher_program/attempt_{attempt}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    train_loop(rank, world)


def fail_now(rank: int) -> None:
    """This rank fails, as LP_FAIL_HOW says, once every rank is READY."""
    world = int(os.environ.get("LP_WORLD", "2"))
    deadline = time.monotonic() + 60
    while count_ready() < world and time.monotonic() < deadline:
        time.sleep(0.01)
    how = os.environ.get("LP_FAIL_HOW", "raise")
    if how == "os_exit":
        os._exit(3)
    if how == "raise_exit":
        raise SystemExit(3)  # no hook sees it: the process's exit status tells
    while how == "loop":  # pure Python: the interpreter switches threads, so the watcher runs
        pass
    raise RuntimeError(f"rank {rank} failed on purpose")


def train_loop(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    block = os.environ.get("LP_BLOCK", "allreduce")
    fail_rank = int(os.environ.get("LP_FAIL_RANK", "-1"))
    for step in range(steps()):
        dist.all_reduce(t)
        if step == READY_AT_STEP:
            ready(rank)
            if rank == fail_rank:
                fail_now(rank)
            if block == "store":
                store = dist.distributed_c10d._get_default_store()
                store.wait(["set-by-a-rank-that-died"], TIMEOUT)
        time.sleep(STEP_S)
    dist.destroy_process_group()


def ddp_main() -> None:
    """A DistributedDataParallel model over gloo: the gradients' all_reduce runs inside
    backward(), on DDP's reducer (C++), where a survivor's collective fails."""
    if peerwatch_on():
        import peerwatch

        peerwatch.install()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=TIMEOUT)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step_fn(x: "torch.Tensor", y: "torch.Tensor") -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    model_loop(dist.get_rank(), step_fn)
    dist.destroy_process_group()


# -- torch.multiprocessing.spawn ----------------------------------------------------


def spawn_worker(i: int, world: int) -> None:
    if peerwatch_on() and os.environ.get("LP_WORKER_INSTALL", "1") == "1":
        import peerwatch

        peerwatch.install(rank=i, world_size=world)
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(i))
    dist.init_process_group("gloo", rank=i, world_size=world, timeout=TIMEOUT)
    train_loop(i, world)


def spawn(install_in_parent: bool) -> None:
    if install_in_parent and peerwatch_on():
        import peerwatch

        peerwatch.install()
    import torch.multiprocessing as mp

    world = int(os.environ.get("LP_WORLD", "2"))
    mp.spawn(spawn_worker, args=(world,), nprocs=world, join=True)


# -- Hugging Face Accelerate, DeepSpeed -----------------------------------------------


def accelerate_main() -> None:
    if peerwatch_on():
        import peerwatch

        peerwatch.install()  # the one line, as in any script run by `accelerate launch`
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step_fn(x: "torch.Tensor", y: "torch.Tensor") -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)  # DDP: the gradients' all_reduce, over gloo
        optimizer.step()
        optimizer.zero_grad()

    model_loop(accelerator.process_index, step_fn)


def deepspeed_main() -> None:
    if peerwatch_on():
        import peerwatch

        peerwatch.install()
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", timeout=TIMEOUT)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=config,
    )

    def step_fn(x: "torch.Tensor", y: "torch.Tensor") -> None:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)  # the gradients' all_reduce, over gloo
        engine.step()

    model_loop(engine.global_rank, step_fn)


def model_loop(rank: int, step_fn: "object") -> None:
    """Train a tiny model with ``step_fn(x, y)`` (one step, gradients all-reduced); READY,
    LP_FAIL_RANK and LP_BLOCK as in train_loop."""
    import torch
    import torch.distributed as dist

    fail_rank = int(os.environ.get("LP_FAIL_RANK", "-1"))
    for step in range(steps()):
        step_fn(torch.randn(4, 4), torch.randn(4, 1))  # type: ignore[operator]
        if step == READY_AT_STEP:
            ready(rank)
            if rank == fail_rank:
                fail_now(rank)
            if os.environ.get("LP_BLOCK") == "store":
                dist.distributed_c10d._get_default_store().wait(["set-by-a-rank-that-died"], TIMEOUT)
        time.sleep(STEP_S)


# -- Lightning ----------------------------------------------------------------------


def lightning(callback: bool) -> None:
    if peerwatch_on():
        import peerwatch

        peerwatch.install()  # the one line; rank 0 runs it before Lightning starts the others
    import lightning as L
    import torch

    fail_rank = int(os.environ.get("LP_FAIL_RANK", "-1"))  # raises once it is READY
    period = float(os.environ.get("LP_OBSERVER_PERIOD", "0"))
    if period:
        # Lightning's _ChildProcessObserver looks at rank 0's children every 5 s; make it
        # look all the time, so that a test sees what happens when it fires.
        from lightning.fabric.strategies.launchers import subprocess_script

        init = subprocess_script._ChildProcessObserver.__init__
        subprocess_script._ChildProcessObserver.__init__ = (  # type: ignore[method-assign]
            lambda self, main_pid, child_processes, sleep_period=5: init(self, main_pid, child_processes, period)
        )
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if self.global_step == READY_AT_STEP:
                ready(self.global_rank)
                if self.global_rank == fail_rank:
                    fail_now(fail_rank)
                if os.environ.get("LP_BLOCK") == "store":
                    import torch.distributed as dist

                    dist.distributed_c10d._get_default_store().wait(["set-by-a-rank-that-died"], TIMEOUT)
            time.sleep(STEP_S)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callbacks = []
    if callback:
        from peerwatch.integrations.lightning import PeerWatch

        callbacks.append(PeerWatch())
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=int(os.environ.get("LP_WORLD", "2")),
        max_steps=steps(), max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    try:
        trainer.fit(Tiny(), data)
    finally:
        # A failing rank's cleanup (saving a checkpoint, uploading logs) takes a while.
        time.sleep(float(os.environ.get("LP_CLEANUP_S", "0")) if trainer.global_rank == fail_rank else 0)


def main() -> None:
    # DeepSpeed's launcher puts --local_rank=<i> before the script's own arguments.
    mode = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    if mode == "worker":
        worker()
    elif mode == "ddp":
        ddp_main()
    elif mode == "spawn":
        spawn("--install-in-parent" in sys.argv)
    elif mode == "accelerate":
        accelerate_main()
    elif mode == "deepspeed":
        deepspeed_main()
    elif mode == "lightning":
        lightning("--callback" in sys.argv)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
