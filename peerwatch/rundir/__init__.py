"""The run directory: where it lives (basedir), whether to trust it (trust), the descriptors
held on it (dirfd), its layout and records (rundir), making it ready (prepare), the event log
and this process's own records (eventlog), this rank's exit record (exitwatch) and stack file
(stacks), and collecting finished ones (gc).

Imports: core, proc.
"""
