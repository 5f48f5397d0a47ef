"""Processes through the OS: who one is, what it does, the descriptors the watcher sleeps on, signals.
Imports: core.
"""
