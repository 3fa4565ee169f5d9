"""Faults a shipped case plants on purpose: damage to artefacts on disk (damage) and the one rank
hook a case needs (hooks: kill a rank mid-save). Test doubles live in tests/doubles.py."""
