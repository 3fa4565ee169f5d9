"""Is a candidate release safe to bump to? Environments as data (envspec, stdlib only: run as a
script before any venv exists), the bump gate (bump), the golden corpus of on-disk artefacts
(golden) and the comparison of two results.json (compare)."""
