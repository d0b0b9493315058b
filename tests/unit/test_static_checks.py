"""The code is `ruff` and `mypy` clean (CONVENTIONS.md): checked by the suite, so CI refuses a change
that is not. Both tools come with the `dev` extra that `./dev setup` installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.timeout(600)
def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-cache", "reliable_kafka", "tests", "benchmarks", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_the_package() -> None:
    result = _run("mypy", "--no-incremental", "--cache-dir", "/dev/null", "reliable_kafka")
    assert result.returncode == 0, result.stdout + result.stderr
