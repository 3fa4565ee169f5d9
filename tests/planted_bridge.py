"""A planted Megatron-Bridge candidate: a buildable copy of the installed release with faults that an
environment variable switches on, so one candidate venv serves every gate test.

`CKPT_TEST_PLANT` (read by the planted code in whichever process imports it; the baseline's
unplanted copy ignores it):
- `import`: `import megatron.bridge` fails (its __init__ imports a module the package does not ship).
- `export-attr`: every HF export raises AttributeError inside the Bridge's own code (a model bridge
  reads an attribute no bridge class defines): a plain regression of the candidate.
- `kill`: the HF export kills the process that runs the case (a run that dies part-way).
- `public-api`: `AutoBridge.save_hf_pretrained`, a public API the harness calls, is gone.
- `internal-api`: `megatron.bridge.peft.canonical_lora.CanonicalLoRA`, an internal class the
  harness's canonical-LoRA driver imports, is gone (only canonical-LoRA cases reach for it).
- `alpha`: the exported adapter_config.json says lora_alpha 32 whatever alpha was asked (the
  verl #1821 class of defect).
- `flaky`: the first HF export raises (the file CKPT_TEST_PLANT_ONCE is created then), every later
  one works: a failure that does not reproduce.

The tree lives at a fixed place in the harness's own cache, so the same content keys the same
candidate venv run after run (a tmp path would key, and keep, a new venv each time).
"""

from __future__ import annotations

import shutil
from importlib import util
from pathlib import Path

PLANT = "CKPT_TEST_PLANT"
_ON = f'__import__("os").environ.get("{PLANT}")'

#: file (under megatron/bridge) -> (text that must occur once, what replaces it)
EDITS: dict[str, list[tuple[str, str]]] = {
    "__init__.py": [(
        "import megatron.bridge.diffusion.models  # noqa: F401",
        f'if {_ON} == "import":\n    import megatron.bridge._planted_missing_module  # noqa: F401\n'
        "import megatron.bridge.diffusion.models  # noqa: F401",
    )],
    "models/conversion/peft_bridge.py": [(
        '"lora_alpha": getattr(peft_config, "alpha", 32)',
        f'"lora_alpha": 32 if {_ON} == "alpha" else getattr(peft_config, "alpha", 32)',
    )],
}
#: code put at the top of a function's body: (file, the `def` line's first text, the code)
BODY_TOP: list[tuple[str, str, str]] = [
    ("models/conversion/model_bridge.py", "    def stream_weights_megatron_to_hf(\n        self,",
     f'        if {_ON} == "export-attr":\n            self._planted_attribute_no_bridge_defines\n'
     f'        if {_ON} == "kill":\n            import os, signal\n            os.kill(os.getppid(), signal.SIGKILL)\n'
     f'        if {_ON} == "flaky":\n            import os\n            try:\n'
     f'                os.close(os.open(os.environ["{PLANT}_ONCE"], os.O_CREAT | os.O_EXCL))\n'
     f'            except FileExistsError:\n                pass\n'
     f'            else:\n                raise RuntimeError("planted: the first export fails, no later one")\n'),
]
#: code appended to a module
APPEND: dict[str, str] = {
    "models/conversion/auto_bridge.py": f'\nif {_ON} == "public-api":\n    del AutoBridge.save_hf_pretrained\n',
    "peft/canonical_lora.py": f'\nif {_ON} == "internal-api":\n    del CanonicalLoRA\n',
}


def _insert_at_body_top(text: str, def_start: str, code: str) -> str:
    """`code` as the first statements of the function whose `def` starts with `def_start` (after its
    docstring, so the function's documentation stays what it was)."""
    assert text.count(def_start) == 1, def_start
    at = text.index(def_start)
    colon = text.index(") ->", at)
    body = text.index("\n", colon) + 1
    doc = text.index('"""', body)
    end = text.index('"""', doc + 3) + 3
    end = text.index("\n", end) + 1
    return text[:end] + code + text[end:]


def planted_bridge(cache: Path) -> Path:
    """The planted tree under `cache`: written once per content (same content, same venv key), under a
    lock and by rename, so two test workers never build a venv from a half-written tree."""
    import fcntl

    from harness.gate.envspec import tree_digest

    trees = cache / "test-trees"
    trees.mkdir(parents=True, exist_ok=True)
    tree = trees / "megatron-bridge-planted"
    with open(trees / ".planted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fresh = _write(trees / f".planted-{__import__('os').getpid()}")
        if tree.exists() and tree_digest(tree, git=False) == tree_digest(fresh, git=False):
            shutil.rmtree(fresh)  # our own scratch copy
        else:
            shutil.rmtree(tree, ignore_errors=True)  # our own scratch tree under the cache, nothing else
            fresh.rename(tree)
    return tree


def _write(tree: Path) -> Path:
    src = Path(util.find_spec("megatron.bridge").origin).parent
    shutil.rmtree(tree, ignore_errors=True)  # our own scratch tree under the cache, nothing else
    shutil.copytree(src, tree / "megatron" / "bridge", ignore=shutil.ignore_patterns("__pycache__"))
    root = tree / "megatron" / "bridge"
    for rel, edits in EDITS.items():
        path = root / rel
        text = path.read_text()
        for old, new in edits:
            assert text.count(old) == 1, (rel, old)
            text = text.replace(old, new)
        path.write_text(text)
    for rel, def_start, code in BODY_TOP:
        path = root / rel
        path.write_text(_insert_at_body_top(path.read_text(), def_start, code))
    for rel, code in APPEND.items():
        path = root / rel
        path.write_text(path.read_text() + code)
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "megatron-bridge"\nversion = "0.6.2+planted"\nrequires-python = ">=3.12"\n'
        '[tool.setuptools.packages.find]\nnamespaces = true\ninclude = ["megatron.bridge*"]\n'
        '[tool.setuptools.package-data]\n"*" = ["*"]\n'
    )
    return tree
