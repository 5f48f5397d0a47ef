"""Probes a live process's identity while another thread takes descriptors away, as an
application does with ``os.closerange`` or a ``dup2`` over a range: a descriptor opened for
a probe may be replaced by /dev/null, or closed, between its open and its read. Prints how
many probes of the live process said it was not there, or could not tell (``wrong=K``).

    python clobber_probe_program.py PID PROBES
"""

from __future__ import annotations

import errno
import os
import sys
import threading

from peerwatch.proc import identity

WINDOW = 16  # descriptor numbers the other thread keeps taking


def _looks_gone_or_unknown(pid: int) -> bool:
    """A probe of the live process that said "gone" (None) or "cannot tell" (Unknown): the
    descriptors taken away are no want of descriptors, and the probe reads again."""
    try:
        return identity.probe(pid) is None
    except identity.Unknown:
        return True


def main() -> None:
    pid, probes = int(sys.argv[1]), int(sys.argv[2])
    devnull = os.open(os.devnull, os.O_RDONLY)
    low = max(devnull, 3) + 1  # the lowest free numbers: where the probes' opens land
    stop = threading.Event()

    def take_away() -> None:
        while not stop.is_set():
            for fd in range(low, low + WINDOW):
                try:
                    os.dup2(devnull, fd, inheritable=False)
                except OSError as e:  # EBUSY: the number is being handed out by an open() right now
                    if e.errno != errno.EBUSY:
                        raise
            os.closerange(low, low + WINDOW)

    thread = threading.Thread(target=take_away, daemon=True)
    thread.start()
    try:
        wrong = sum(1 for _ in range(probes) if _looks_gone_or_unknown(pid))
    finally:
        stop.set()
        thread.join()
    print(f"wrong={wrong}")


if __name__ == "__main__":
    main()
