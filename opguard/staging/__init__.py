"""Local staging: node-local trace files published to shared storage as immutable batches.

This package imports neither ``opguard.launcher`` nor ``opguard.cli``, nor torch or mpi4py.
"""
