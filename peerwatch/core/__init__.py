"""Values and rules every package shares: the errors a user sees, the records of a run
directory and their codec, the configuration, what a terminal is told, when the watcher wakes
(schedule), the awake clock, the mount table. Pure: no I/O, no clock, no threads (config reads
the environment once, into a frozen value). This file imports nothing: ``import peerwatch``
loads this package and its errors only.

Imports: nothing else of peerwatch.
"""
