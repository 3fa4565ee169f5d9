"""Processes: launch one function on N ranks (world, rank_entry for torchrun), warm imports
(preload, forkserver_preload), the one rank envelope every case world goes through (envelope),
the rank's backend event sink (events) and launcher self-test functions (probes)."""
