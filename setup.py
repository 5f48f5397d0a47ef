"""Only the optional C extension lives here; the metadata is in setup.cfg.

``peerwatch._exitstatus`` (glibc's on_exit(3): the exit status Python cannot see) is
optional: where it cannot be built (no compiler, no Python headers, a libc without
on_exit such as musl), the install goes on without it and peerwatch says so at
``install()`` (see docs/security.md, "Success needs evidence").
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("peerwatch._exitstatus", ["peerwatch/_exitstatus.c"], optional=True)])
