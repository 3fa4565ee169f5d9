"""Faults a shipped case plants on purpose: damage to artefacts on disk (damage) and the rank hooks
cases need (hooks: kill a rank mid-save, kill an async write in flight), and mutants of installed
upstream code for a mutation campaign (mutants: made from the source; mutant_hook: loaded in every
process of a world, never written). Test doubles live in tests/doubles.py."""
