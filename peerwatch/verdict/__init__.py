"""A verdict and what follows it: decide and plan (pure), enforce, notify, report, leave.
Imports: core, proc, rundir, hangs.
"""
