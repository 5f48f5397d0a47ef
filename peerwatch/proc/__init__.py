"""Processes, through the OS: who a process is (identity), what it is doing (activity), what
the watcher sleeps on (sources: pidfds, a child's exit status; inotify; waker: the poll set),
and signalling verified process trees (teardown, with peerwatch's own signals).

Imports: core.
"""
