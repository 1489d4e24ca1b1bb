"""Helpers for the crash-consistency, fault-injection and round-trip tests (a producer model, target checks)."""
