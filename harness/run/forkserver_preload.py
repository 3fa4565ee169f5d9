"""Imported by the forkserver before it forks ranks (multiprocessing.set_forkserver_preload takes
module names). megatron-core only: a Bridge rank imports the Bridge itself (harness.models.bridge.build)."""

from harness.run.preload import warm

warm(bridge=False)
