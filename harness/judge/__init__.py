"""Judging: turn what ranks returned into Checks (checks), and the xfail and budget policy that
decides a case's final status (xfail, budget). Imports only harness.core."""
