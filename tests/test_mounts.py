"""The mount table (peerwatch.core.mounts): which filesystem holds a path, and whether other
hosts may write it. Pure: parses a mountinfo text given as a string."""

from __future__ import annotations

from typing import List

import pytest

from peerwatch.core.mounts import MOUNTINFO, NETWORK_FS_TYPES, Mount, is_network_fs, mount_of, parse_mountinfo

pytestmark = pytest.mark.pure  # no process, no thread, no file: conftest skips its scan for leaks

# Lines as proc(5) writes them: id parent major:minor root mount_point options [optional...] -
# fstype source super_options.
TABLE = r"""27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 27 0:45 / /mnt/nfs rw,relatime shared:30 master:2 - nfs4 filer:/export rw,vers=4.2
42 27 0:47 / /scratch rw - lustre 10.0.0.1@o2ib:/scratch rw
44 27 0:49 / /mnt/my\040share\134x rw - cifs //srv/my\011share rw
45 27 0:50 / /short rw - tmpfs tmpfs
"""


def test_parse_mountinfo_reads_point_type_and_source() -> None:
    assert parse_mountinfo(TABLE) == [
        Mount("/", "ext4", "/dev/vda"),
        Mount("/mnt/nfs", "nfs4", "filer:/export"),  # two optional fields before the dash
        Mount("/scratch", "lustre", "10.0.0.1@o2ib:/scratch"),  # none: the dash is the 7th field
        Mount("/mnt/my share\\x", "cifs", "//srv/my\tshare"),  # octal escapes, in both paths
        Mount("/short", "tmpfs", "tmpfs"),  # no super options: still read
    ]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "not a mountinfo line",
        "27 1 254:0 / / rw,relatime shared:1 ext4 /dev/vda rw",  # no dash
        "27 1 254:0 / / rw - ext4",  # no source after the type
        "27 1 - / / rw ext4 /dev/vda rw",  # a dash before the optional fields is not the separator
    ],
)
def test_parse_mountinfo_skips_a_malformed_line(line: str) -> None:
    assert parse_mountinfo(line + "\n" + "42 27 0:47 / /scratch rw - lustre src rw") == [
        Mount("/scratch", "lustre", "src")
    ]


def test_parse_mountinfo_of_nothing() -> None:
    assert parse_mountinfo("") == []


def mounts(*points: str) -> List[Mount]:
    return [Mount(p, f"fs{i}", f"src{i}") for i, p in enumerate(points)]


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/mnt/nfs/run", "/mnt/nfs"),
        ("/mnt/nfs", "/mnt/nfs"),  # the mount point itself
        ("/mnt/nfsx/run", "/mnt"),  # /mnt/nfs is a prefix of the name, not of the path
        ("/mnt/nfs-other", "/mnt"),
        ("/mntx", "/"),
        ("/mnt/nfs-other/deep/run", "/mnt/nfs-other/deep"),
        ("/mnt", "/mnt"),
        ("/mnt/a", "/mnt"),
        ("/home/u", "/"),
        ("/", "/"),
    ],
)
def test_mount_of_is_the_longest_whole_component_prefix(path: str, expected: str) -> None:
    # /mnt is mounted after /mnt/nfs: order does not make a shorter point win.
    table = mounts("/", "/mnt/nfs", "/mnt/nfs-other/deep", "/mnt")
    found = mount_of(path, table)
    assert found is not None and found.mount_point == expected


def test_mount_of_a_point_written_with_a_trailing_slash() -> None:
    table = mounts("/", "/data/")
    assert mount_of("/data/run", table) == table[1]
    assert mount_of("/datax", table) == table[0]
    table = mounts("/", "/data/", "/d")  # /d is shorter than /data/ but mounted later
    assert mount_of("/data/run", table) == table[1]


def test_mount_of_the_last_mount_on_a_point_wins() -> None:
    table = [Mount("/", "ext4", "a"), Mount("/mnt/nfs", "nfs4", "b"), Mount("/mnt/nfs", "tmpfs", "c")]
    assert mount_of("/mnt/nfs/run", table) == table[2]
    table = [Mount("/", "ext4", "a"), Mount("/", "overlay", "b")]
    assert mount_of("/x", table) == table[1]


def test_mount_of_without_a_root_mount() -> None:
    assert mount_of("/home/u", mounts("/mnt/nfs")) is None
    assert mount_of("/home/u", []) is None


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "lustre", "gpfs", "ceph", "fuse.ceph-fuse", "cifs", "wekafs"])
def test_network_filesystems(fstype: str) -> None:
    assert is_network_fs(fstype) is True
    assert fstype in NETWORK_FS_TYPES


@pytest.mark.parametrize("fstype", ["ext4", "xfs", "tmpfs", "overlay", "fuse.sshfs_local", "NFS4", ""])
def test_local_filesystems(fstype: str) -> None:
    assert is_network_fs(fstype) is False


def test_the_table_is_read_from_the_processs_own_mountinfo() -> None:
    assert MOUNTINFO == "/proc/self/mountinfo"
