"""Optional integrations (torch, Lightning). Importing this package imports neither.
Imports: peerwatch, proc, rundir.
"""
