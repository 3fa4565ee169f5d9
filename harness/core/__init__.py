"""The bottom floor: values and pure functions every layer may use, importing nothing above.

spec (CaseSpec, XFail, markers), topology (Topology), cut (--max-world), options (typed options),
zoo (model specs), truth (canonical weights: the harness's own answer), parity (shards, tolerances,
comparison), result (Check, CaseResult), requires (machine requirements), memory (psutil phase
records and budgets), context (RankContext: what a rank function receives).
"""
