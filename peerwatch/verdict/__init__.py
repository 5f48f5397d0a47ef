"""A verdict and what follows it: the decision (decide) and the teardown plan (plan), both
pure; an enforcer's share (enforce), the on_verdict hook (notify) below its keeper (keeper, run
as its own program), the report (report), and how a rank leaves (leave). The plan's steps are
carried out in order by peerwatch.executor, above.

Imports: core, proc, rundir, hangs.
"""
