"""The command line (cli: ``peerwatch report|status|ls|gc|doctor``), the doctor's checks and
self-test (doctor), the timeline picture (timeline). Above the API: the self-test runs a real
job through ``peerwatch.install()``.

Imports: peerwatch, core, proc, rundir, hangs, hosts, verdict.
"""
