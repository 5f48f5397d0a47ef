"""The folder watch (peerwatch.proc.waker): real inotify instances on real folders.

What wakes the watcher (a new entry, by link or rename) and what must not (a rescan's
listing and reads, a removal); that a number taken over by the application is told apart
from our instance, even by another inotify instance (every one is the same inode to
fstat), and is never read from or closed; and the fallback to polling.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, List

import pytest

from peerwatch.proc.waker import FolderWatch, watched_inodes

DEADLINE_MS = 5000
QUIET_MS = 200  # a watch that must not fire is given this long to prove it


@pytest.fixture
def folders(tmp_path: Path) -> List[str]:
    made = [tmp_path / "events", tmp_path / "ranks"]
    for folder in made:
        folder.mkdir()
    return [str(f) for f in made]


@pytest.fixture
def watches() -> Iterator[List[FolderWatch]]:
    made: List[FolderWatch] = []
    yield made
    for watch in made:
        watch.stop()


def _watch(folders: List[str], watches: List[FolderWatch]) -> FolderWatch:
    watch = FolderWatch(folders)
    watches.append(watch)
    assert watch.active and watch.fd is not None, "inotify is out of instances on this machine"
    return watch


def _ready(fd: int, ms: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(ms))


def test_a_new_entry_by_link_or_rename_fires_and_is_drained(folders, watches, tmp_path):
    watch = _watch(folders, watches)
    assert set(watched_inodes(watch.fd) or []) == {os.stat(f).st_ino for f in folders}
    temp = tmp_path / "temp"
    temp.write_text("{}")
    os.link(temp, os.path.join(folders[0], "exit-00001.json"))
    assert _ready(watch.fd, DEADLINE_MS)
    assert watch.drain()
    assert not _ready(watch.fd, 0), "drained"
    os.rename(temp, os.path.join(folders[1], "rank-00001.json"))
    assert _ready(watch.fd, DEADLINE_MS)
    assert watch.drain() and watch.intact()


def test_a_rescan_or_a_removal_does_not_fire(folders, watches):
    name = os.path.join(folders[0], "ack-00002.json")
    with open(name, "w") as f:
        f.write("{}")
    watch = _watch(folders, watches)
    for folder in folders:
        os.listdir(folder)
    with open(name) as f:
        f.read()
    os.unlink(name)
    assert not _ready(watch.fd, QUIET_MS)


def test_a_number_the_application_put_dev_null_over_is_not_ours(folders, watches):
    watch = _watch(folders, watches)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, watch.fd)
        assert not watch.intact()
        assert not watch.drain(), "/dev/null reads as end of file: not an inotify instance"
        fd = watch.fd
        watch.abandon()
        assert os.fstat(fd)  # the application's /dev/null is left open
    finally:
        os.close(null)
        os.close(fd)


def test_another_inotify_instance_in_its_place_is_neither_ours_nor_closed(folders, watches, tmp_path):
    """inotify instances are all one inode to fstat: only what they watch tells them apart."""
    watch = _watch(folders, watches)
    fd = watch.fd
    os.close(fd)  # the application's os.closerange
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = _watch([str(elsewhere)], watches)
    if theirs.fd != fd:
        os.dup2(theirs.fd, fd)  # the application's dup2 puts its instance on our number
    try:
        assert not watch.intact()
        watch.stop()  # must not close the application's instance
        assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    finally:
        if theirs.fd != fd:
            os.close(fd)


def test_a_closed_number_is_not_ours_and_not_drained(folders, watches):
    watch = _watch(folders, watches)
    os.close(watch.fd)
    assert not watch.intact() and not watch.drain()
    watch.abandon()


def test_a_released_watch_watches_nothing_keeps_its_number_and_stop_closes_it(folders, watches, tmp_path):
    """A teardown releases its watch rather than close it (a close with watches held waits
    for the kernel to free them): nothing watched any more, the number still open and
    ours, not polled; stop() closes it."""
    watch = _watch(folders, watches)
    fd = watch.fd
    assert fd is not None
    watch.release()
    assert watch.fd is None and not watch.active
    assert watched_inodes(fd) == [], "every watch removed"
    os.fstat(fd)  # still open
    (tmp_path / "temp").write_text("{}")
    os.link(tmp_path / "temp", os.path.join(folders[0], "exit-00001.json"))
    assert _drained_to_ignored(fd), "a new entry no longer queues an event"
    watch.stop()
    with pytest.raises(OSError):
        os.fstat(fd)


def _drained_to_ignored(fd: int) -> bool:
    """Only IN_IGNORED events (the watches' removal) are queued on ``fd``."""
    import struct

    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return True
    IN_IGNORED = 0x8000
    offset = 0
    while offset < len(data):
        _, mask, _, name_len = struct.unpack_from("iIII", data, offset)
        if not mask & IN_IGNORED:
            return False
        offset += 16 + name_len
    return True


def test_disabled_or_a_missing_folder_means_polling_with_no_descriptor_left(folders, caplog):
    before = set(os.listdir("/proc/self/fd"))
    assert not FolderWatch(folders, disabled=True).active
    missing = FolderWatch([folders[0], folders[1] + "-gone"])
    assert not missing.active and missing.fd is None
    assert "polling instead" in caplog.text
    assert set(os.listdir("/proc/self/fd")) <= before


def test_out_of_descriptors_means_polling_and_says_why(folders):
    """inotify_init1 fails with EMFILE at the per-user limit of instances, as at the
    per-process limit of descriptors, which a test can reach alone."""
    program = textwrap.dedent(f"""
        import logging, os, resource, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from peerwatch.proc.waker import FolderWatch, _libc_calls
        _libc_calls()  # ctypes imported and bound while a descriptor can still be opened
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        watch = FolderWatch({folders!r})
        print("active", watch.active, watch.fd)
    """)
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    assert "active False None" in out.stdout and "polling instead" in out.stdout
    assert "fs.inotify.max_user_instances" in out.stdout
