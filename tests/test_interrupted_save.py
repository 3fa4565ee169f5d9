"""interrupted-save in real worlds, shown to go red: a save protocol that marks the directory
complete before writing (doubles:mark_checkpoint_complete_first) fails
recognised-incomplete, and a backend that swallows load errors (SwallowLoadErrors) makes the load
of the interrupted directory silent, which fails outcome. The green runs are matrices/faults.yaml."""

import pytest
from doubles import use_doubles

from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(test_swallow_load_errors="doubles:SwallowLoadErrors")


def _spec(backend, kind):
    return CaseSpec("interrupted-save", "gpt-gqa", backend, Topology.parse("tp2"), Topology.parse("tp1pp2"),
                    options=(("interruption", kind),), axes=("interruption",), timeout_s=90)


def test_a_directory_marked_complete_before_the_write_turns_the_case_red():
    r = run_case(_spec("mcore_dist", "kill-after-shard"), RunOptions(rank_hooks=("doubles:mark_checkpoint_complete_first",)))
    assert r.status == "failed", r.failure_text()
    assert r.check("recognised-incomplete").status == "failed"
    assert "calls the interrupted directory a checkpoint" in r.check("recognised-incomplete").detail
    assert r.check("tracker").status == "passed"  # the tracker is still right: only megatron-core's rule is fooled


def test_a_backend_that_swallows_load_errors_makes_the_load_silent_and_red():
    r = run_case(_spec("test_swallow_load_errors", "async-not-finalized"))
    assert r.status == "failed", r.failure_text()
    assert r.check("interruption").status == "passed"
    assert r.check("outcome").status == "failed" and r.check("outcome").detail.startswith("silent:")
    assert r.check("loaded-canonical").status == "failed"
