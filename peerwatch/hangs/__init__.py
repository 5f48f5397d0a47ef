"""Hangs and stragglers as one host sees them: torch's collective counters (collectives),
this rank's heartbeat (heartbeat) and the time it waits in collectives (waits), the hang
diagnosis (diagnose) and a host's stall as other hosts need it (summary), the straggler finding
(straggler), torch's flight recorder dumped for its analyzer (frdump). diagnose, summary and
straggler are pure.

Imports: core, proc, rundir.
"""
