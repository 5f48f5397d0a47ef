"""The run directory: where it lives, whether to trust it, its records and event log, a rank's last words.
Imports: core, proc.
"""
