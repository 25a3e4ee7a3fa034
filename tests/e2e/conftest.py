"""Whole-system runs: their prompt set (`arith_prefix`) is the session's, in tests/conftest.py."""
