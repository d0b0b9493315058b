"""The package as an index serves it: the built wheel, installed into fresh virtualenvs without extras and
with the cli extra, as `pip install reliable-kafka` and `pip install 'reliable-kafka[cli]'` would.

test_light_import.py hides the extras inside this environment; this one installs the real thing, so a
module missing from the wheel or a dependency missing from its metadata shows here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built as pip builds it for an index (isolated, with the setuptools pyproject.toml asks for).
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT, cwd=out)
    assert built.returncode == 0, built.stderr
    (found,) = out.glob("reliable_kafka-*.whl")
    return found


def test_the_wheel_carries_the_module_spark_registers_the_data_source_from(wheel: Path) -> None:
    # Spark 4 imports installed top-level pyspark_* modules and registers their DefaultSource.
    with zipfile.ZipFile(wheel) as built:
        assert "pyspark_reliable_kafka.py" in built.namelist()


def _venv(where: Path, requirement: str) -> Path:
    """A fresh virtualenv (cwd outside the checkout, so only the installed copy can be imported).

    It gets no pip of its own: this environment's pip installs into it (`pip --python`), the same
    resolver and metadata, without ensurepip's 7 s; and --no-compile skips byte-compiling every
    dependency (on a quiet host this module took 37 s with a pip per virtualenv and byte-compiling, 20 s so).
    """
    made = _run(sys.executable, "-m", "venv", "--without-pip", where, cwd=where.parent)
    assert made.returncode == 0, made.stderr
    installed = _run(sys.executable, "-m", "pip", "--python", where / "bin" / "python", "install", "-q",
                     "--no-compile", requirement, cwd=where.parent)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return where / "bin"


def test_the_wheel_without_extras_imports_and_its_cli_names_the_extra(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "plain", str(wheel))
    probe = ("import sys, reliable_kafka; from reliable_kafka import ReliableProducer, ReliableConsumer; "
             "print(reliable_kafka.__file__); "
             "print(sorted(m for m in ('click', 'rich', 'redis', 'pyspark', 'pandas') if m in sys.modules))")
    imported = _run(bin_dir / "python", "-c", probe, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    where, loaded = imported.stdout.splitlines()
    assert str(tmp_path / "plain") in where, "the installed copy was imported, not the checkout"
    assert loaded == "[]"
    helped = _run(bin_dir / "reliable-kafka", "--help", cwd=tmp_path)
    assert helped.returncode == 2
    assert helped.stdout == ""
    (line,) = helped.stderr.strip().splitlines()
    # Which module is named depends on the dependencies (sqlite-utils brings click along): rich is not.
    assert re.fullmatch(r"error: reliable-kafka's command line needs the cli extra \(module '\w+' is not "
                        r"installed\): pip install 'reliable-kafka\[cli\]'", line), line


def test_the_wheel_with_the_cli_extra_runs_its_command_line(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "cli", f"reliable-kafka[cli] @ {wheel.as_uri()}")
    helped = _run(bin_dir / "reliable-kafka", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    for command in ("lab", "bench", "doctor", "cluster", "outbox"):
        assert command in helped.stdout
    listed = _run(bin_dir / "reliable-kafka", "lab", "--list", cwd=tmp_path)
    assert listed.returncode == 0 and "acks1-leader-loss" in listed.stdout, listed.stderr
    # No pyspark in this install: the Spark scenario is skipped, named by the module its extra is for, and
    # the run is not a loss (exit 0: nothing ran, nothing of ours lost); no cluster is started for it.
    skipped = _run(bin_dir / "reliable-kafka", "lab", "spark-task-retry", "--json", "-", cwd=tmp_path)
    assert skipped.returncode == 0, skipped.stderr
    report = json.loads(skipped.stdout)
    assert report["scenarios"] == [] and report["exit_code"] == 0, report
    assert report["skipped"] == {"spark-task-retry": "needs pyspark: pip install 'reliable-kafka[spark]'"}, report
