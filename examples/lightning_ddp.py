"""peerwatch with Lightning: Trainer(strategy="ddp", accelerator="cpu", devices=3).

How to run:

    python examples/lightning_ddp.py                  # 3 ranks; rank 1 is SIGKILLed at step 20
    FAIL_RANK=0 python examples/lightning_ddp.py      # rank 0, the parent of the other ranks, dies
    FAIL_HOW=raise python examples/lightning_ddp.py   # rank 1 raises instead
    FAIL_RANK=-1 python examples/lightning_ddp.py     # nobody fails: trains STEPS steps, exits 0

    DEVICES (3), FAIL_RANK (1; -1: none), FAIL_STEP (20), FAIL_HOW (kill, raise, exit, os_exit), STEPS (60)

The one line at the top is all it takes: rank 0 runs it before Lightning's subprocess
launcher starts ranks 1..N-1, which inherit PEERWATCH_DIR and join rank 0's run. The
PeerWatch callback is optional: it records progress every batch, marks the rank done at
the end of fit, and reports the verdict through Lightning's logging.

What you will see when a rank fails: the failing rank's traceback (if it raised), the
report's summary (`peerwatch report DIR` prints it again), then from each surviving rank,
blocked in DDP's gradient all_reduce, one line, "peerwatch: rank 0 (pid ... on ...) stops
with exit code 137: rank 1 (pid ... on ...) failed first (killed by SIGKILL)"; every process is gone
within milliseconds. Every rank exits with the failing rank's exit code: 137 for a
SIGKILL (rank 0 is rank 1's parent and reads how it died), 1 for an exception, 3 for
sys.exit(3). When rank 0 itself is SIGKILLed, only its own parent (your shell) knows
how: the other ranks exit with peerwatch's documented code for that case, 1. Without
peerwatch: with gloo, the survivors' all_reduce fails ("Connection reset by peer") and
they exit 1 with a traceback each, after a while; with NCCL they wait for its timeout,
until Lightning's own observer in rank 0 notices (within 5 s, and only when rank 0 is
alive) and SIGKILLs them all.
"""

from __future__ import annotations

import os
import signal
import sys

import peerwatch

peerwatch.install()  # the one line: at the top, before the Trainer starts the other ranks

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from peerwatch.integrations.lightning import PeerWatch  # noqa: E402

DEVICES = int(os.environ.get("DEVICES", "3"))
FAIL_RANK = int(os.environ.get("FAIL_RANK", "1"))
FAIL_STEP = int(os.environ.get("FAIL_STEP", "20"))
FAIL_HOW = os.environ.get("FAIL_HOW", "kill")
STEPS = int(os.environ.get("STEPS", "60"))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.global_rank == FAIL_RANK and self.global_step == FAIL_STEP:
            print(f"[rank {self.global_rank}] failing at step {self.global_step} ({FAIL_HOW})", flush=True)
            if FAIL_HOW == "raise":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            if FAIL_HOW == "exit":
                sys.exit(3)
            if FAIL_HOW == "os_exit":
                os._exit(3)  # no exception, no exit hook: only rank 0, its parent, sees the code
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    x = torch.randn(512, 32)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=DEVICES, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, callbacks=[PeerWatch()],
    )
    trainer.fit(Regression(), data)


if __name__ == "__main__":
    main()
