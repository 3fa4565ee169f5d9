"""A matrix of cases -> results: the YAML reader (matrix), the runner with its not-run, xfail and
--jobs handling (runner) and the hypothesis explorer (explore), the throughput benchmark (bench, bench_rank). Above cases, below the gate."""
