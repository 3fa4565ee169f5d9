"""Faults a shipped case plants on purpose: damage to artefacts on disk (damage) and the rank hooks
cases need (hooks: kill a rank mid-save, kill an async write in flight). Test doubles live in
tests/doubles.py."""
