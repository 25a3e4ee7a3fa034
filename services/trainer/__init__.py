"""The trainer service."""
