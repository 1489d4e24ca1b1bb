"""Helpers shared by test files of several parts (imported, never collected: no test_ prefix)."""
