"""Other hosts: the store bridge (bridge) and which local rank runs it (election), the
store's keys (store_protocol) and a client with deadlines (store_client), the rules over hosts
(hosts, pure), the shared-filesystem mode (sharedfs), and the straggler finding carried out
across hosts (stragglerwatch).

Imports: core, proc, rundir, hangs.
"""
