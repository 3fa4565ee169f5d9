"""What pyproject.toml cannot say: the wheel's package list. Every harness package as found (a new
subpackage goes in by itself), plus the clone's top-level cases/ (with its subpackages) and matrices/ as harness.cases and
harness.matrices (mapped by package-dir in pyproject.toml). Nothing else: no top-level `cases`,
`benchmarks` or `tests` in site-packages (tests/test_wheel.py)."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["harness", "harness.*"]), "harness.cases",
               *(f"harness.cases.{p}" for p in find_packages(where="cases")), "harness.matrices"])
