"""Pure values and rules every package shares (config alone reads the environment, once).
No code here: ``import peerwatch`` loads only this package and its errors.
Imports: nothing else of peerwatch.
"""
