"""Carrying out a teardown plan (:mod:`peerwatch.verdict.plan`) with the OS (:mod:`peerwatch.proc.teardown`).

Runs in the watcher thread. An enforcer waits for its peers' acknowledgements, then
signals the ones that gave none, with their process trees, and the children that the
failed rank left behind. Every process signalled is verified first: the pid, start time
and uid of its registration, and that it holds its rank's stack file open (the OS
vouches that it is that rank), or, for a left-behind child, that it inherited the run
directory or holds the stack file.
"""

from __future__ import annotations

import logging
import os
import time
from typing import AbstractSet, Dict, List, Mapping, Protocol, Set

from ..core import terminal
from ..core.records import Heartbeat, NotSignalled, Registration, Verdict
from ..proc import identity, teardown
from ..proc.identity import is_local
from ..rundir import eventlog
from ..rundir.rundir import HEARTBEATS, RANKS, RunDir, rank_file
from . import plan

logger = logging.getLogger("peerwatch")


class _Peer(Protocol):
    reg: Registration


class _Sleeps(Protocol):
    def wait(self, timeout: float) -> bool: ...


class Seen(Protocol):
    """What an enforcer needs of the watcher's observer (:class:`peerwatch.observer.Observer`
    has it): passed down, so this stage does not import the one that observes."""

    run_dir: RunDir
    me: Registration
    gone: Dict[int, int]
    registrations: Dict[int, Registration]

    @property
    def peers(self) -> Mapping[int, _Peer]: ...
    @property
    def local(self) -> _Sleeps: ...  # what the watcher sleeps on (peerwatch.peers.LocalPeers)

    def scan(self) -> None: ...
    def flush(self) -> None: ...
    def acked(self) -> Set[int]: ...
    def finished(self) -> Set[int]: ...
    def local_pids(self) -> Set[int]: ...
    def write_event(self, name: str, record: object) -> bool: ...


def tear_down_peers(
    obs: Seen, verdict: Verdict, ack_window_s: float, grace_s: float, trusted: AbstractSet[int] = frozenset(),
) -> None:
    """Give live peers the ack window to say they are leaving; signal those that do not.
    ``trusted``: peers never signalled here (a blind enforcer's fellow enforcers;
    rule: the blind enforcer); ``ack_window_s`` is the plan's (longer for a blind enforcer)."""
    pending = _await_acks(obs, ack_window_s, trusted)
    peer_pids = obs.local_pids()
    targets: List[teardown.Target] = []
    if pending:
        tree = teardown.process_tree()
        finished = obs.finished()
        for rank in pending:
            targets.extend(_peer_and_tree(obs, obs.peers[rank].reg, finished, peer_pids, tree))
    targets.extend(_orphans_of(obs, verdict, peer_pids))
    if targets:
        reason = f"rank {verdict.rank} failed ({verdict.cause}) and this process did not leave by itself"
        teardown.terminate(targets, grace_s, reason, eventlog.note)
        teardown.close_all(targets)
        # The last records of the peers it ended (exits written as SIGTERM ended them)
        # reach the event log.
        eventlog.sweep(obs.run_dir, obs.me.rank)


def _await_acks(obs: Seen, ack_window_s: float, trusted: AbstractSet[int]) -> List[int]:
    """Wait for acknowledgements (or, blind, for the peers' processes to end: their pidfds
    wake us); the ranks that gave none (rules: the ack window, the blind enforcer)."""
    window = plan.AckWindow.opened(time.monotonic(), ack_window_s)
    while True:
        obs.scan()
        obs.flush()
        acked = obs.acked()
        pending = plan.pending(obs.peers, obs.me.rank, set(obs.gone), acked, trusted)
        now = time.monotonic()
        window = window.seen(now, len(acked))
        if not pending or window.left(now) <= 0:
            return list(pending)
        obs.local.wait(window.left(now))


def _peer_and_tree(
    obs: Seen, reg: Registration, finished: AbstractSet[int], peer_pids: AbstractSet[int], tree: dict,
) -> List[teardown.Target]:
    target = teardown.make_target(reg.pid, reg.start_ticks, reg.uid, f"rank {reg.rank}", rank=reg.rank)
    if target is None:
        try:
            info = identity.probe(reg.pid)
        except identity.Unknown:
            info = None  # cannot tell (out of descriptors...): not verified, so not signalled
        if info is not None and not info.dead and info.start_ticks == reg.start_ticks and info.uid != reg.uid:
            _not_signalled(obs, reg, f"it now runs as uid {info.uid}, not uid {reg.uid} as it registered")
        return []  # else it is gone (or its pid is another process now): nothing to signal
    stack_path = obs.run_dir.stack_at(reg.rank)
    if not teardown.holds_file(reg.pid, stack_path):
        problem = teardown.stack_file_problem(stack_path)
        why = f"rank {reg.rank}'s stack file {problem}" if problem else f"it does not hold rank {reg.rank}'s stack file"
        obs.run_dir.warn_once(
            obs.run_dir.join(RANKS, rank_file("rank", reg.rank)),
            f"names pid {reg.pid}, but {why}: not a verified peer, not signalled",
        )
        _not_signalled(
            obs, reg, f"rank {reg.rank}'s stack file {problem}" if problem else
            f"pid {reg.pid} does not hold rank {reg.rank}'s stack file open (it exec'd another program, "
            "or closed its descriptors)",
        )
        target.close()
        return []
    if plan.ask_for_stacks(reg.rank, finished):
        teardown.send(target, teardown.STACKS_SIGNAL, "dump stacks", eventlog.note)  # terminate() lets it be taken first
    found = [target]
    for pid, started in teardown.descendants(reg.pid, reg.uid, set(peer_pids), tree):
        child = teardown.make_target(pid, started, reg.uid, f"pid {pid}, a descendant of rank {reg.rank} (pid {reg.pid})")
        if child is not None:
            found.append(child)
    return found


def _not_signalled(obs: Seen, reg: Registration, reason: str) -> None:
    """Say, in the log and for the report, that a peer could not be verified and was not signalled."""
    logger.warning(
        "peerwatch: %s could not be verified, not signalled: %s", terminal.who(reg.rank, reg.pid, reg.host), reason,
    )
    record = NotSignalled(rank=reg.rank, pid=reg.pid, time_ns=time.time_ns(), reason=reason, observed_by=obs.me.rank)
    obs.write_event(rank_file("unsignalled", reg.rank), record)


def _orphans_of(obs: Seen, verdict: Verdict, peer_pids: AbstractSet[int]) -> List[teardown.Target]:
    """Descendants of the failed rank (from its last heartbeat) that outlived it."""
    reg = obs.registrations.get(verdict.rank)
    beat = obs.run_dir.read(HEARTBEATS, rank_file("rank", verdict.rank), Heartbeat)
    if reg is None or beat is None or beat.pid != reg.pid or not is_local(reg):
        return []
    found = []
    stack_path = obs.run_dir.stack_at(verdict.rank)
    for pid, start in beat.children:
        if pid in peer_pids:
            continue
        target = teardown.make_target(pid, start, reg.uid, f"pid {pid}, left behind by rank {verdict.rank} (pid {reg.pid})")
        if target is None:
            continue
        # Vouched for by the OS: it inherited the run directory from the rank (a child
        # started after install()), or the rank's stack file (a forked worker).
        if teardown.inherited_run(pid, obs.run_dir.path) or teardown.holds_file(pid, stack_path):
            found.append(target)
        else:
            target.close()
            logger.info("peerwatch: pid %d, named as a child of rank %d, is not vouched for; not signalled",
                        pid, verdict.rank)
    return found


def tear_down_own_children(
    rank: int, peer_pids: AbstractSet[int], grace_s: float, spare: AbstractSet[int] = frozenset(),
) -> None:
    """This rank's own descendants (DataLoader workers...), but never a peer, nor the trees
    in ``spare`` (the on_verdict command this rank runs: its own bound ends it)."""
    uid = os.geteuid()
    targets = [
        t for t in (
            teardown.make_target(pid, start, uid, f"pid {pid}, a descendant of rank {rank} (pid {os.getpid()})")
            for pid, start in teardown.descendants(os.getpid(), uid, set(peer_pids), spare=spare)
        ) if t is not None
    ]
    if targets:
        teardown.terminate(targets, grace_s, f"rank {rank} is being torn down", eventlog.note)
        teardown.close_all(targets)


__all__ = ["Seen", "tear_down_own_children", "tear_down_peers"]
