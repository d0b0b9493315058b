"""`import reliable_kafka` loads no optional or heavy module, and a part used without its extra says which
extra to install in one line (the CLI: on stderr with exit code 2) instead of a traceback.

Each check runs in a fresh interpreter: this test process has long imported everything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("click", "rich", "pandas", "numpy", "pyspark", "pyarrow", "redis", "sqlite_utils", "matplotlib", "psutil")

# A meta-path finder that makes the extras' modules look uninstalled, as on `pip install reliable-kafka`.
BLOCK_EXTRAS = textwrap.dedent(
    """
    import sys

    class _NotInstalled:
        blocked = {"click", "rich", "redis", "pyspark", "pyarrow", "pandas", "numpy", "matplotlib", "psutil"}

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    # cwd=ROOT puts this checkout first on sys.path, ahead of any installed copy of the package.
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_import_loads_no_optional_or_heavy_module() -> None:
    result = _python(f"import sys, reliable_kafka; print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_import_works_without_any_extra() -> None:
    result = _python(BLOCK_EXTRAS + "import reliable_kafka, reliable_kafka.errors; print('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cli_without_its_extra_prints_one_line_and_exits_2() -> None:
    result = _python(BLOCK_EXTRAS + "from reliable_kafka.cli.main import main; main()")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: reliable-kafka's command line needs the cli extra")
    assert lines[0].endswith("pip install 'reliable-kafka[cli]'")


def _missing_extra(code: str) -> str:
    """Run `code` without the extras; it must raise MissingExtra, an ImportError; returns its message."""
    probe = BLOCK_EXTRAS + textwrap.dedent(
        f"""
        from reliable_kafka.errors import MissingExtra, ReliableKafkaError
        try:
            {code}
        except ImportError as exc:
            assert isinstance(exc, MissingExtra) and isinstance(exc, ModuleNotFoundError), type(exc)
            assert isinstance(exc, ReliableKafkaError)
            print(exc)
        else:
            raise SystemExit("no error")
        """
    )
    result = _python(probe)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def test_redis_store_without_its_extra_names_the_extra() -> None:
    message = _missing_extra("import reliable_kafka; reliable_kafka.RedisDedupStore")
    assert message.startswith("RedisDedupStore needs the redis extra")
    assert "pip install 'reliable-kafka[redis]'" in message


def test_spark_connector_without_its_extra_names_the_extra() -> None:
    message = _missing_extra("import reliable_kafka.spark")
    assert "needs the spark extra" in message
    assert "pip install 'reliable-kafka[spark]'" in message


def test_reopening_an_outbox_does_not_load_sqlite_utils(tmp_path: Path) -> None:
    """sqlite-utils creates an outbox's schema; a restart that reopens the file does not load it (nor the
    pandas it imports when installed), and the reopened outbox still takes and keeps messages."""
    path = tmp_path / "o.db"
    code = textwrap.dedent(
        f"""
        import sys
        from reliable_kafka.outbox import Outbox
        from reliable_kafka.spool import NewMessage
        o = Outbox({str(path)!r}, durability="fsync")
        o.append([NewMessage(f"id-{{len(o.pending())}}", "t", b"v")])
        print(len(o.pending()), "sqlite_utils" in sys.modules)
        o.close()
        """
    )
    created, reopened = _python(code), _python(code)
    assert created.returncode == 0 and reopened.returncode == 0, created.stderr + reopened.stderr
    assert created.stdout.split() == ["1", "True"]  # a new file: the schema is sqlite-utils' work
    assert reopened.stdout.split() == ["2", "False"]


def test_reopening_a_sqlite_dedup_store_does_not_load_sqlite_utils(tmp_path: Path) -> None:
    path = tmp_path / "dedup.db"
    code = textwrap.dedent(
        f"""
        import sys
        from reliable_kafka.dedup import SQLiteDedupStore
        store = SQLiteDedupStore({str(path)!r})
        done = store.claim(["k"]).done
        store.confirm(["k"])
        print(sorted(done), "sqlite_utils" in sys.modules)
        store.close()
        """
    )
    created, reopened = _python(code), _python(code)
    assert created.returncode == 0 and reopened.returncode == 0, created.stderr + reopened.stderr
    assert created.stdout.split() == ["[]", "True"]
    assert reopened.stdout.split() == ["['k']", "False"]  # the key confirmed by the first run is known
