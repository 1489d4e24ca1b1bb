"""Spec-compatible spelling: ``python -m opguard.local_sync.materialize SOURCE DEST``."""
