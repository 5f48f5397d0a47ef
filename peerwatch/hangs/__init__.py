"""Hangs and stragglers as one host sees them: collective counters, heartbeats, waits, their diagnosis.
Imports: core, proc, rundir.
"""
