"""Other hosts: the store bridge, its election, keys and client, the rules over hosts, a shared filesystem.
Imports: core, proc, rundir, hangs.
"""
