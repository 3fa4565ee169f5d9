"""The rank side of the cases: what runs inside a rank of a case's worlds (a case's own rank half,
and the training phase and Bridge job several cases drive). Imports no case module (tests/test_layout.py)."""
