"""Checkpoint plans: what a save at one topology writes and a load at another reads, predicted
without a GPU or a cluster (every model-parallel rank built on the meta device under torch's fake
process group). `ckpt-harness plan`; docs/plan.md.

Its own wing on the backends' floor: it builds models (above harness.models and harness.run) and
nothing below orchestration imports it."""
