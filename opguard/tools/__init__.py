"""Offline report tools (``python -m opguard.tools <command>``)."""
