"""`torchrun ... -m harness.run.rank_entry SPEC WORKDIR`: one phase of a case on a torchrun/srun world.

SPEC is a pickle of {fn, arg, timeout_s, hooks, logs} written by `harness.run.world.dump_spec`; the rank writes its result to
WORKDIR like a locally launched world does, so the runner reads results the same way.
"""

import pickle
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from harness.run.world import run_from_env


@record  # torchrun then reports the failing rank's traceback as the root cause
def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m harness.run.rank_entry SPEC.pkl WORKDIR")
    with open(argv[0], "rb") as f:
        spec = pickle.load(f)
    run_from_env(spec["fn"], spec["arg"], argv[1], timeout_s=spec["timeout_s"], hooks=spec["hooks"], logs=spec.get("logs"))


if __name__ == "__main__":
    main(sys.argv[1:])
