"""A collective that fails because a peer went is an echo, not a cause: the verdict names
the peer, whichever reached the run directory first. Real gloo jobs, and the pure rule
that tells an exception raised by torch.distributed (``collectives.raised_by_torch_distributed``)."""

from __future__ import annotations

import platform
import sys

import pytest

from peerwatch.hangs.collectives import in_torch_distributed
from peerwatch.hangs.collectives import raised_by_torch_distributed as from_collective
from peerwatch.hooks import spawn_wrapped

GRACE_S = 1.0
GONE_S = 0.5 + GRACE_S + 5.0
SLOW_EXIT_S = 2.0  # the cleanup at exit of the rank that raised SystemExit, after its process group is gone
# A deadline, not a latency: the job ends once the rank that raised SystemExit has finalized,
# which took up to 5 s on 2 loaded cores (from when it began to leave to its exit status).
LEAVE_S = 30.0
GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the test wants the traceback
        return e


def test_what_torch_distributed_raises_is_told_by_its_words_type_or_frames() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39590: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert from_collective(gloo, None)
    assert from_collective(RuntimeError("NCCL communicator was aborted on rank 1"), None)
    own = _raised(ValueError("loss is nan"))
    assert not from_collective(own, own.__traceback__)
    assert not from_collective(KeyError("step"), None)


def test_a_users_exception_raised_inside_ddps_forward_is_no_collectives() -> None:
    """Under DDP every training step runs inside torch/nn/parallel/distributed.py's
    forward(): the frame an exception is raised in tells, not the frames it passed."""
    ddp = {}
    exec(compile("def forward(step):\n    return step()\n", "/venv/torch/nn/parallel/distributed.py", "exec"), ddp)
    dist = {}
    exec(compile("def wait():\n    raise RuntimeError('timed out')\n", "/venv/torch/distributed/c10d.py", "exec"), dist)

    def training_step() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    own = _raised_by(lambda: ddp["forward"](training_step))
    assert not from_collective(own, own.__traceback__)
    collective = _raised_by(lambda: ddp["forward"](dist["wait"]))
    assert from_collective(collective, collective.__traceback__)


def test_inside_torch_distributed_is_its_package_and_ddp() -> None:
    """One definition, for the heartbeat's "waiting inside torch.distributed" and for an
    exception "raised by torch.distributed"."""
    assert in_torch_distributed("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
    assert in_torch_distributed("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py")  # DDP
    assert not in_torch_distributed("/venv/lib/python3.11/site-packages/torch/nn/parallel/data_parallel.py")
    assert not in_torch_distributed("/home/me/mytorch/distributed/train.py")
    assert not in_torch_distributed("/venv/lib/python3.11/site-packages/torch/autograd/graph.py")


@pytest.mark.parametrize("path, inside", [
    ("/venv/torch/nn/parallel/distributed.py", True),  # DDP's forward: its bucket rebuild, its buffers' broadcast
    ("/venv/torch/distributed/distributed_c10d.py", True),
    ("/venv/torch/nn/parallel/data_parallel.py", False),  # one process: no peer to wait for
    ("/venv/torch/autograd/graph.py", False),  # where DDP's gradient all-reduces are waited for: unseen by all
])
def test_the_heartbeat_the_wait_sampler_and_the_hooks_agree_on_inside_torch_distributed(path: str, inside: bool) -> None:
    """Issue 25.3: "inside torch.distributed" meant three things: the hooks took all of
    torch/nn/parallel, the heartbeat DDP's module too, the wait sampler only the package.
    A real main thread blocked in a frame of ``path`` (os.read, C, below it) is waiting
    there for the heartbeat and for the sampler, and an exception raised there is raised
    by torch.distributed, for all three or for none."""
    import os
    import threading
    import time

    from peerwatch.hangs.heartbeat import main_thread_position
    from peerwatch.hangs.waits import SAMPLE_S, WaitSampler

    code: dict = {}
    exec(compile("def wait(fd):\n    return os.read(fd, 1)\ndef fail():\n    raise RuntimeError('x')\n", path, "exec"),
         {"os": os}, code)
    raised = _raised_by(code["fail"])
    assert from_collective(raised, raised.__traceback__) is inside

    main = threading.main_thread()
    seen: dict = {}
    r, w = os.pipe()
    sampler = WaitSampler(97)

    def observe() -> None:
        try:
            deadline = time.monotonic() + 10.0
            while getattr(sys._current_frames().get(main.ident or 0), "f_code", None) is not code["wait"].__code__:
                assert time.monotonic() < deadline, "the main thread never blocked in wait()"
                time.sleep(0.01)  # polls a frame: nothing to wait on; the deadline bounds it
            seen["position"] = main_thread_position()
            sampler.moving(True)
            sampler.start()
            while sampler.counts[0] < 3:
                assert time.monotonic() < deadline, sampler.counts
                time.sleep(SAMPLE_S)
            seen["counts"] = sampler.counts
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            seen["error"] = e
        finally:
            sampler.stop()
            os.write(w, b"x")

    observer = threading.Thread(target=observe, name="test-observer")
    observer.start()
    try:
        code["wait"](r)
    finally:
        observer.join(15.0)
        os.close(r)
        os.close(w)
        for t in threading.enumerate():
            if t.name == "peerwatch-waits-rank97":
                t.join(5.0)
    assert "error" not in seen, seen
    where, waiting = seen["position"]
    samples, waits = seen["counts"]
    assert waiting is inside, seen
    assert waits == (samples if inside else 0), seen  # the main thread stayed in wait() throughout
    assert where.endswith(" in wait") is not inside, where  # its position is the first frame outside torch.distributed


def test_an_error_of_ddps_reducer_raised_inside_backward_is_told_by_its_words() -> None:
    """DDP's gradient all_reduce fails inside autograd's C++ engine: the innermost frame is
    autograd's; the backend's words say what it is."""
    graph: dict = {}
    gloo = ("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. "
            "This is typically caused by a remote worker crashing.")
    src = f"def run_backward():\n    raise RuntimeError({gloo!r})\n"
    exec(compile(src, "/venv/torch/autograd/graph.py", "exec"), graph)
    echo = _raised_by(graph["run_backward"])
    assert from_collective(echo, echo.__traceback__)


_WRAPPER = """
import sys
def _wrap(probe, exc):
    try:
        if exc is not None:
            raise exc
    except Exception:
        return probe(sys._getframe())   # where it calls sys.exit(1)
    return probe(sys._getframe())
"""


def test_the_exception_behind_an_exit_is_taken_only_from_torch_spawns_wrapper() -> None:
    """torch.multiprocessing.spawn's _wrap turns a worker's exception into sys.exit(1):
    the exception is the failure. An exit called in an except block anywhere else is the
    program's own choice of how to end, with its own code."""
    torch_spawn: dict = {}
    exec(compile(_WRAPPER, "/venv/torch/multiprocessing/spawn.py", "exec"), torch_spawn)
    cause = torch_spawn["_wrap"](spawn_wrapped, ValueError("loss is nan"))
    assert isinstance(cause, ValueError) and str(cause) == "loss is nan" and cause.__traceback__ is not None
    assert torch_spawn["_wrap"](spawn_wrapped, None) is None  # sys.exit(1) outside an except block
    cli: dict = {}
    exec(compile(_WRAPPER, "/home/me/cli.py", "exec"), cli)
    assert cli["_wrap"](spawn_wrapped, ValueError("bad config")) is None
    assert spawn_wrapped(None) is None


def _raised_by(call) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test wants the traceback
        return e
    raise AssertionError("it did not raise")


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_a_rank_sigkilled_inside_its_collectives_is_the_cause_not_a_peer_whose_read_failed(make_job) -> None:
    """Every rank loops on all_reduce; rank 2 is SIGKILLed. Its sockets close a moment
    before its pidfd fires, so a peer's "Connection reset by peer" can be recorded first."""
    pytest.importorskip("torch")
    job = make_job(world=4, grace=GRACE_S, gloo=True, behave=[f"{r}=gloo" for r in range(4)]).start()
    job.wait_ready(timeout=60.0)
    job.wait_noted([f"collective-{r}" for r in range(4)], timeout=30.0)
    job.kill(2)
    job.wait_gone(within=GONE_S)
    v = job.report()["verdict"]
    assert (v["rank"], v["cause"]) == (2, "vanished"), f"{v}\n{job.logs()}"


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_gloo_blames_the_rank_that_raised_system_exit(make_job) -> None:
    """The issue's example: ranks 0 and 2 block in a gloo all_reduce while rank 1 leaves
    with ``raise SystemExit(3)`` at the top. Their collectives fail while it finalizes,
    before its exit status is known; the verdict is on rank 1, with its code."""
    pytest.importorskip("torch")
    if not GLIBC:
        pytest.skip("a SystemExit at the top is only seen through glibc's on_exit")
    job = make_job(world=3, grace=GRACE_S, gloo=True, behave=["0=gloo", "1=pg+raise_exit:3@0.5", "2=gloo"]).start()
    job.wait_ready(timeout=60.0)
    job.wait_gone(within=LEAVE_S)
    v = job.report()["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (1, "exit", 3), f"{v}\n{job.logs()}"
    assert job.all_returncodes() == {r: 3 for r in range(3)}, job.logs()


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_gloo_blames_the_rank_that_raised_system_exit_however_long_it_takes_to_leave(make_job) -> None:
    """Rank 1 leaves with ``raise SystemExit(3)``; at exit it destroys its process group
    (the others' all_reduce fails at once: "Connection closed by peer") and then takes
    ``SLOW_EXIT_S`` to clean up before its exit status is written. It said it was leaving
    before its sockets closed: the echoes wait for its end, and the verdict is on rank 1,
    exit 3. Before, an echo was named the cause 0.5 s after it was raised."""
    pytest.importorskip("torch")
    if not GLIBC:
        pytest.skip("a SystemExit at the top is only seen through glibc's on_exit")
    behave = ["0=gloo", f"1=pg+slow_exit:{SLOW_EXIT_S}+raise_exit:3@0.5", "2=gloo"]
    job = make_job(world=3, grace=GRACE_S, gloo=True, behave=behave).start()
    job.wait_ready(timeout=60.0)
    job.wait_gone(within=SLOW_EXIT_S + LEAVE_S)
    v = job.report()["verdict"]
    assert (v["rank"], v["cause"], v["exit_code"]) == (1, "exit", 3), f"{v}\n{job.logs()}"
    assert job.all_returncodes() == {r: 3 for r in range(3)}, job.logs()
    # The echoes' tracebacks are not printed: each waited for the verdict before its
    # excepthook printed (before, both were printed: the first look found no failure).
    for rank in (0, 2):
        log = job.log_path(rank).read_text(errors="replace")
        assert "Traceback" not in log and "Connection closed by peer" not in log, job.logs()
