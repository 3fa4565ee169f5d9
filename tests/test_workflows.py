"""The CI workflows' shards and their merge agree (.github/workflows/ci.yml, nightly-gpu.yml): a job
over `shard: [1..N]` runs `--shard ${{ matrix.shard }}/N` and uploads one artifact per shard; a
merge job needs it, runs `if: always()`, downloads every shard's artifact and merges them with
`--matrix` naming the matrix the shards ran (and `-k` where they took one). The pytest groups
likewise: `group: [1..N]` with `--splits N --group ${{ matrix.group }}`. Edit one side only and a
test here goes red."""

from __future__ import annotations

import copy
import fnmatch
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
SHARD, GROUP = "${{ matrix.shard }}", "${{ matrix.group }}"
_K = re.compile(r"(?:^|[\s(])-k\s")  # a -k argument, also inside a bash array: args+=(-k "$K")


def _load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _runs(job: dict) -> list[str]:
    return [str(s.get("run", "")) for s in job.get("steps", [])]


def _with(job: dict, action: str) -> list[dict]:
    return [s.get("with") or {} for s in job.get("steps", []) if str(s.get("uses", "")).startswith(action)]


def _needs(job: dict) -> list[str]:
    needs = job.get("needs") or []
    return [needs] if isinstance(needs, str) else list(needs)


def _matrix_file(runs: list[str]) -> str | None:
    """The matrix a shard runs: named in its run line, or in the script the line calls (scripts/smoke)."""
    text = " ".join(runs)
    found = re.search(r"\brun (\S+\.ya?ml)", text)
    if found:
        return found[1]
    script = re.search(r"(?:^|\s)(scripts/[\w-]+)", text)
    if script and (ROOT / script[1]).is_file():
        found = re.search(r"\brun (\S+\.ya?ml)", (ROOT / script[1]).read_text())
    return found[1] if found else None


def _counted(job: dict, key: str) -> int | None:
    values = ((job.get("strategy") or {}).get("matrix") or {}).get(key)
    return len(values) if values == list(range(1, len(values or []) + 1)) else -1 if values is not None else None


def problems(doc: dict) -> list[str]:
    """Every way the shard jobs, their merge and the pytest groups of one workflow disagree."""
    out: list[str] = []
    jobs = doc["jobs"]
    for name, job in jobs.items():
        n = _counted(job, "group")
        if n == -1:
            out.append(f"{name}: the group values are not 1..N")
        elif n is not None:
            splits = re.findall(r"--splits (\d+) --group " + re.escape(GROUP), " ".join(_runs(job)))
            if [int(s) for s in splits] != [n]:
                out.append(f"{name}: {n} groups in the matrix, but --splits {splits or 'missing'} --group {GROUP}")
        n = _counted(job, "shard")
        if n is None:
            continue
        if n == -1:
            out.append(f"{name}: the shard values are not 1..N")
            continue
        runs = [r for r in _runs(job) if "--shard" in r]
        given = re.findall(r"--shard " + re.escape(SHARD) + r"/(\d+)", " ".join(runs))
        if [int(g) for g in given] != [n]:
            out.append(f"{name}: {n} shards in the matrix, but --shard {SHARD}/{given or 'missing'}")
        artifacts = [w.get("name", "") for w in _with(job, "actions/upload-artifact") if SHARD in str(w.get("name", ""))]
        if len(artifacts) != 1:
            out.append(f"{name}: uploads no per-shard artifact (a name with {SHARD})")
            continue
        names = {artifacts[0].replace(SHARD, str(i)) for i in range(1, n + 1)}
        mergers = [m for m, j in jobs.items() if any(re.search(r"\bmerge\b", r) for r in _runs(j))
                   and (name in _needs(j) or any(fnmatch.filter(names, str(d.get("pattern", ""))) for d in _with(j, "actions/download-artifact")))]
        if not mergers:
            out.append(f"{name}: no job merges its shards")
        for m in mergers:
            mj = jobs[m]
            if name not in _needs(mj):
                out.append(f"{m}: does not need the shard job {name}")
            if "always()" not in str(mj.get("if", "")):
                out.append(f"{m}: no `if: always()`: a failed shard would skip the merge that names it")
            merge = next(r for r in _runs(mj) if re.search(r"\bmerge\b", r))
            matrix = re.search(r"--matrix (\S+)", merge)
            if not matrix or matrix[1] != _matrix_file(runs):
                out.append(f"{m}: merges --matrix {matrix and matrix[1]}, the shards run {_matrix_file(runs)}")
            downloads = [d for d in _with(mj, "actions/download-artifact")
                         if all(fnmatch.fnmatchcase(a, str(d.get("pattern", ""))) for a in names)
                         and f"{d.get('path')}/{d.get('pattern')}" in merge]
            if not downloads:
                out.append(f"{m}: downloads and merges no pattern matching all of {sorted(names)}")
            if bool(_K.search(" ".join(runs))) != bool(_K.search(merge)):
                out.append(f"{m}: -k on one side only: the merge would expect other cases than the shards ran")
    return out


@pytest.mark.parametrize("name, sharded", [("ci.yml", {"smoke-shard"}), ("nightly-gpu.yml", {"nightly-gpu"})])
def test_the_shards_and_their_merge_agree(name, sharded):
    doc = _load(name)
    assert {j for j, job in doc["jobs"].items() if _counted(job, "shard")} == sharded
    assert problems(doc) == []


def test_the_test_suite_job_runs_the_readme_command_in_groups():
    job = _load("ci.yml")["jobs"]["test"]
    assert _counted(job, "group") == 3 and any(r.startswith(".ci/run ") for r in _runs(job))
    assert "exec scripts/test \"$@\"" in (ROOT / ".ci" / "run").read_text()


def _step(job: dict, needle: str) -> dict:
    return next(s for s in job["steps"] if needle in str(s.get("run", "")) + str(s.get("with", "")))


def _plant_shard_count(d):
    d["jobs"]["smoke-shard"]["strategy"]["matrix"]["shard"] = [1, 2]


def _plant_shard_n(d):
    s = _step(d["jobs"]["smoke-shard"], "--shard")
    s["run"] = s["run"].replace("/3", "/4")


def _plant_needs(d):
    d["jobs"]["smoke-report"]["needs"] = []


def _plant_always(d):
    del d["jobs"]["smoke-report"]["if"]


def _plant_matrix(d):
    s = _step(d["jobs"]["smoke-report"], "merge shards/")
    s["run"] = s["run"].replace("--matrix matrices/smoke.yaml", "--matrix matrices/extended.yaml")


def _plant_no_matrix(d):
    s = _step(d["jobs"]["smoke-report"], "merge shards/")
    s["run"] = s["run"].replace("--matrix matrices/smoke.yaml", "")


def _plant_artifact(d):
    _step(d["jobs"]["smoke-shard"], "smoke-shard-")["with"]["name"] = "smoke-part-" + SHARD


def _plant_groups(d):
    d["jobs"]["test"]["strategy"]["matrix"]["group"] = [1, 2, 3, 4]


def _plant_splits(d):
    s = _step(d["jobs"]["test"], "--splits")
    s["run"] = s["run"].replace("--splits 3", "--splits 2")


@pytest.mark.parametrize("plant, words", [
    (_plant_shard_count, "--shard"), (_plant_shard_n, "--shard"), (_plant_needs, "does not need"),
    (_plant_always, "always()"), (_plant_matrix, "--matrix"), (_plant_no_matrix, "--matrix"),
    (_plant_artifact, "downloads"), (_plant_groups, "--splits"), (_plant_splits, "--splits"),
])
def test_an_edit_to_one_side_is_caught(plant, words):
    doc = copy.deepcopy(_load("ci.yml"))
    plant(doc)
    found = problems(doc)
    assert found and any(words in p for p in found), found


def test_a_k_on_the_shards_only_is_caught():
    doc = copy.deepcopy(_load("nightly-gpu.yml"))
    merge = _step(doc["jobs"]["merge"], "merge shards/")
    merge["run"] = merge["run"].replace('[ -n "$K" ] && args+=(-k "$K")', "")
    assert any("-k on one side only" in p for p in problems(doc))


def _bench_args(job: dict) -> list[str]:
    """The `ckpt-harness bench` arguments a workflow job runs (continuation lines joined, $OUT kept as a word)."""
    import shlex

    for run in _runs(job):
        text = run.replace("\\\n", " ")
        words = shlex.split(text)
        for i, w in enumerate(words):
            if w.endswith("/ckpt-harness") and words[i + 1:i + 2] == ["bench"]:
                return words[i + 2:]
    return []


def test_the_nightly_gpu_bench_job_runs_a_benchmark_the_cli_accepts():
    """The nightly bench job (issue 21 item 4) parses with bench's own parser and names real zoo models, NCCL
    and every strategy bench has, so a renamed flag, model or strategy turns this red, not the nightly run."""
    import argparse

    from harness.core.zoo import get_model
    from harness.orchestration.bench import STRATEGIES, add_parser

    job = _load("nightly-gpu.yml")["jobs"]["bench"]
    words = _bench_args(job)
    assert words, "the bench job runs no `ckpt-harness bench`"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *words])
    assert args.dist_backend == "nccl"
    assert set(args.strategies) == set(STRATEGIES)
    for model in args.models:
        get_model(model, "gpt")  # KeyError names a model the zoo does not have
    assert max(args.worlds) == 8 and any(s.get("uses", "").startswith("actions/upload-artifact") for s in job["steps"])


def test_a_bench_job_with_an_unknown_strategy_is_caught():
    doc = copy.deepcopy(_load("nightly-gpu.yml"))
    for step in doc["jobs"]["bench"]["steps"]:
        if "run" in step and "bench" in step["run"]:
            step["run"] = step["run"].replace("fully_parallel+async", "fully-parallel+async")
    words = _bench_args(doc["jobs"]["bench"])
    import argparse

    from harness.orchestration.bench import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", *words])


# --------------------------------------------------------------------------- untrusted inputs (issue item 7)
#: expressions a caller controls (dispatch inputs, PR fields): spliced into a `run:` script they become shell code
_UNTRUSTED_EXPR = re.compile(r"\$\{\{\s*(?:github\.event\.|inputs\.|github\.head_ref)")


def injection_problems(doc: dict, strict: bool = False) -> list[str]:
    """Every `run:` script that evals or splices a caller-controlled expression (`${{ github.event.* }}`,
    `${{ inputs.* }}`, `${{ github.head_ref }}`) into shell code; `strict`: any `${{ }}` at all (step
    outputs included, which carry those inputs on)."""
    out = []
    for name, job in doc["jobs"].items():
        for i, run in enumerate(_runs(job)):
            if re.search(r"(?:^|[\s;&|(`])eval\s", run):
                out.append(f"{name} step {i}: eval")
            if _UNTRUSTED_EXPR.search(run) or (strict and "${{" in run):
                out.append(f"{name} step {i}: an expression spliced into the script: {run.strip().splitlines()[0][:80]}")
    return out


def test_the_bump_gate_passes_inputs_as_environment_not_shell_code():
    """bridge-bump.yml runs user inputs (the candidate spec, the matrix) and step outputs only through env."""
    assert injection_problems(_load("bridge-bump.yml"), strict=True) == []


@pytest.mark.parametrize("name", ["ci.yml", "nightly-gpu.yml"])
def test_no_workflow_splices_caller_inputs_into_a_script(name):
    assert injection_problems(_load(name)) == []


@pytest.mark.parametrize("plant", [
    lambda run: run.replace('"$(scripts/ensure-env)/bin/ckpt-harness" gate', 'eval "$(scripts/ensure-env)/bin/ckpt-harness" gate'),
    lambda run: run.replace('"$MATRIX"', "${{ github.event.inputs.matrix }}"),
    lambda run: run.replace('"${args[@]}"', "${{ steps.args.outputs.args }}"),
])
def test_an_eval_or_a_spliced_input_is_caught(plant):
    doc = copy.deepcopy(_load("bridge-bump.yml"))
    step = _step(doc["jobs"]["gate"], "ckpt-harness\" gate")
    step["run"] = plant(step["run"])
    assert injection_problems(doc, strict=True)


def _gate_argv(tmp_path: Path, candidate: str, matrix: str, pin_diff: str = "") -> list[str]:
    """Run the gate job's `gate arguments` and `gate` scripts in bash, as the runner would, with stub
    scripts/ensure-env, scripts/pin-diff and ckpt-harness: the argv the harness receives."""
    import os
    import shutil
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    job = _load("bridge-bump.yml")["jobs"]["gate"]
    args_step, gate_step = _step(job, "pin-diff"), _step(job, "ckpt-harness\" gate")
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    dump = tmp_path / "argv"
    stubs = {work / "scripts" / "ensure-env": f"#!{bash}\necho {tmp_path / 'venv'}\n",
             work / "scripts" / "pin-diff": f"#!{bash}\necho '{pin_diff}'\n",
             tmp_path / "venv" / "bin" / "ckpt-harness": f"#!{bash}\nprintf '%s\\0' \"$@\" > {dump}\n"}
    for path, text in stubs.items():
        path.write_text(text)
        path.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "RUNNER_TEMP": str(tmp_path), "GITHUB_OUTPUT": str(tmp_path / "out"),
           "CANDIDATE": candidate, "BASE_REF": "main", "MATRIX": matrix}
    for step in (args_step, gate_step):
        subprocess.run([bash, "-e", "-c", step["run"]], cwd=work, env=env, check=True, capture_output=True, text=True)
    return dump.read_bytes().decode().split("\0")[:-1]


def test_hostile_inputs_reach_the_gate_as_words_and_run_nothing(tmp_path):
    """A spec or matrix name full of shell syntax arrives verbatim and runs nothing (the old `eval` ran it)."""
    marker = tmp_path / "pwned"
    spec = f"megatron-bridge @ git+https://x/y@abc $(touch {marker}) `touch {marker}`"
    matrix = f"m.yaml; touch {marker} #"
    argv = _gate_argv(tmp_path, f" {spec} ; megatron-core==0.19.0 ", matrix)
    assert argv == ["gate", "--candidate", spec, "--candidate", "megatron-core==0.19.0", "--out", "gate", "--", matrix]
    assert not marker.exists()


def test_a_pin_change_becomes_baseline_and_candidate_arguments(tmp_path):
    argv = _gate_argv(tmp_path, "", "matrices/smoke.yaml", "--baseline a==1 --candidate a==2")
    assert argv == ["gate", "--baseline", "a==1", "--candidate", "a==2", "--out", "gate", "--", "matrices/smoke.yaml"]


def test_a_pull_request_gates_on_the_gates_default_matrix(tmp_path):
    """A bump PR names no matrix: the gate runs its own default, matrices/gate.yaml (the smoke slice plus
    every architecture), not the smoke slice alone."""
    import argparse

    from harness.gate.gate_args import add_parser

    argv = _gate_argv(tmp_path, "", "", "--baseline a==1 --candidate a==2")
    assert argv == ["gate", "--baseline", "a==1", "--candidate", "a==2", "--out", "gate"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(argv).matrix == Path("matrices/gate.yaml")
    assert "smoke.yaml" not in (WORKFLOWS / "bridge-bump.yml").read_text()


def test_the_gate_cli_parses_the_workflow_argv():
    """`--out gate -- MATRIX` parses as the gate's own parser reads it (a matrix name may start with '-')."""
    from unittest import mock

    from harness import cli

    with mock.patch("harness.gate.bump.run_gate", return_value=0) as gate:
        assert cli.main(["gate", "--candidate", "a @ b", "--out", "gate", "--", "-m.yaml"]) == 0
    args = gate.call_args
    assert args.args[0] == ["a @ b"] and str(args.args[2]) == "-m.yaml" and str(args.args[4]) == "gate"
    assert args.kwargs["trust_pickles"] is False


# --------------------------------------------------------------------------- hardening (issue 44 item 8)
#: `uses: owner/repo[/path]@<commit>  # vX.Y.Z`: a tag can be moved to other code, a commit cannot
_PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}\s+#\s*v\d+\.\d+\.\d+\s*$")
_USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(.+?)\s*$", re.M)


def hardening_problems(text: str) -> list[str]:
    """What zizmor would flag medium or high, checked without it: an action not pinned to a full commit
    SHA with its release as a comment, a checkout that leaves the token in .git/config, a workflow that
    declares no `permissions` (the token then gets the repository's default, often write-all)."""
    doc = yaml.safe_load(text)
    out = [f"unpinned: uses: {u}" for u in _USES.findall(text) if not u.startswith("./") and not _PINNED.match(u)]
    if "permissions" not in doc:
        out.append("no top-level permissions")
    for name, job in doc["jobs"].items():
        if "permissions" not in job and doc.get("permissions") not in ({}, {"contents": "read"}):
            out.append(f"{name}: no permissions, and the workflow's are not least")
        for i, step in enumerate(job.get("steps", [])):
            if str(step.get("uses", "")).startswith("actions/checkout@") and \
                    (step.get("with") or {}).get("persist-credentials") is not False:
                out.append(f"{name} step {i}: actions/checkout without persist-credentials: false")
    return out


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.yml")))
def test_every_action_is_pinned_and_every_token_least(name):
    assert hardening_problems((WORKFLOWS / name).read_text()) == []


@pytest.mark.parametrize("plant, words", [
    (lambda t: re.sub(r"actions/cache@[0-9a-f]{40}  # v[\d.]+", "actions/cache@v4", t, count=1), "unpinned"),
    (lambda t: re.sub(r"(actions/setup-python@[0-9a-f]{40})  # v[\d.]+", r"\1", t, count=1), "unpinned"),
    (lambda t: t.replace("{persist-credentials: false}", "{}", 1), "persist-credentials"),
    (lambda t: t.replace("\npermissions: {}\n", "\n", 1), "permissions"),
])
def test_a_planted_unpinned_action_or_broad_token_is_caught(plant, words):
    text = (WORKFLOWS / "ci.yml").read_text()
    planted = plant(text)
    assert planted != text
    found = hardening_problems(planted)
    assert found and any(words in p for p in found), found


def _zizmor() -> Path:
    """requirements-tools.txt's zizmor, installed as uv is (pip --target into the cache's tools/), else on PATH."""
    import os
    import shutil

    pin = next(ln.strip() for ln in (ROOT / "requirements-tools.txt").read_text().splitlines() if ln.startswith("zizmor=="))
    home = Path(os.environ.get("CKPT_HARNESS_HOME") or Path.home() / ".cache" / "ckpt-harness")
    target = home / "tools" / re.sub(r"[^A-Za-z0-9.]+", "-", pin)
    if (target / "bin" / "zizmor").is_file():
        return target / "bin" / "zizmor"
    if found := shutil.which("zizmor"):
        return Path(found)
    pytest.skip(f"zizmor is not installed (ci.yml's zizmor job runs it): python3.12 -m pip install --target {target} {pin}")


def _zizmor_findings(github: Path) -> list[str]:
    """zizmor's medium and high findings over a .github directory, offline (no GitHub API)."""
    import json
    import subprocess

    r = subprocess.run([str(_zizmor()), "--offline", "--no-config", "--format", "json", str(github)],
                       capture_output=True, text=True, check=False, cwd=github.parent)
    assert r.stdout.strip(), r.stderr
    return [f"{f['ident']} ({f['determinations']['severity']}): {f['locations'][0]['symbolic']['key']}"
            for f in json.loads(r.stdout) if f["determinations"]["severity"] in ("Medium", "High")]


def test_zizmor_finds_nothing_medium_or_high():
    assert _zizmor_findings(ROOT / ".github") == []


def test_zizmor_catches_a_planted_unpinned_action(tmp_path):
    import shutil

    _zizmor()
    shutil.copytree(ROOT / ".github", tmp_path / ".github")
    ci = tmp_path / ".github" / "workflows" / "ci.yml"
    ci.write_text(re.sub(r"actions/cache@[0-9a-f]{40}  # v[\d.]+", "actions/cache@v4", ci.read_text(), count=1))
    assert any(f.startswith("unpinned-uses") for f in _zizmor_findings(tmp_path / ".github"))


def test_ci_runs_zizmor_at_the_pin():
    runs = " ".join(_runs(_load("ci.yml")["jobs"]["zizmor"]))
    assert "requirements-tools.txt" in runs and re.search(r'zizmor"? --offline --min-severity medium \.github/', runs)


def test_the_cached_corpus_is_keyed_alike_where_written_and_where_read():
    """The corpus job writes under one key and the gate job looks it up from the base branch: both
    hash the same files (the pins and the corpus's own code), or a bump reads a stale corpus (or none)."""
    text = (WORKFLOWS / "bridge-bump.yml").read_text()
    lists = re.findall(r"for f in ([\w./ -]+?); do (?:cat|git show)", text)
    assert len(lists) == 2 and lists[0] == lists[1], lists
    assert "harness/gate/golden.py" in lists[0].split() and "requirements.txt" in lists[0].split()
