"""The command line (report, status, ls, gc, doctor, timeline), above the API: the doctor runs a job.
Imports: peerwatch, core, proc, rundir, hangs, verdict.
"""
