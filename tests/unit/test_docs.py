"""The documentation says what the code does: safe defaults, refused settings and cited proofs.

Every default of reliable_kafka.config is in docs/configuration.md with its value, every setting the
page lists as refused really is refused with a ConfigError naming it, and every test the docs cite
as proof (`tests/...py::test_name`) exists.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from reliable_kafka.config import (
    CONSUMER_DEFAULTS,
    PRODUCER_DEFAULTS,
    TRANSACTIONAL_DEFAULTS,
    consumer_config,
    producer_config,
    transactional_producer_config,
)
from reliable_kafka.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
CITED_PROOF = re.compile(r"(tests/[\w/]+\.py)::([\w:]+)")


def _rendered(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next second-level heading."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize(
    ("key", "value"),
    [*PRODUCER_DEFAULTS.items(), *CONSUMER_DEFAULTS.items(), *TRANSACTIONAL_DEFAULTS.items()],
)
def test_every_safe_default_is_documented_with_its_value(key: str, value: Any) -> None:
    rows = [line for line in CONFIGURATION.read_text().splitlines() if line.startswith(f"| `{key}` |")]
    assert rows, f"docs/configuration.md has no table row for `{key}`"
    assert any(f"`{_rendered(value)}`" in row for row in rows), f"`{key}` is documented without its value {value!r}"


BROKERS = {"bootstrap.servers": "127.0.0.1:9092"}
GROUP = {**BROKERS, "group.id": "g"}

# (what builds the config, the user's settings, the key the ConfigError must name)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("producer", {**BROKERS, "acks": "1"}, "acks"),
    ("producer", {**BROKERS, "acks": 0}, "acks"),
    ("producer", {**BROKERS, "request.required.acks": 1}, "acks"),
    ("producer", {**BROKERS, "enable.idempotence": False}, "enable.idempotence"),
    ("producer", {**BROKERS, "max.in.flight.requests.per.connection": 6}, "max.in.flight.requests.per.connection"),
    ("producer", {**BROKERS, "retries": 10}, "retries"),
    ("producer", {**BROKERS, "message.send.max.retries": 3}, "retries"),
    ("producer", {**BROKERS, "transactional.id": "t-1"}, "transactional.id"),
    ("producer", {}, "bootstrap.servers"),
    ("consumer", {**GROUP, "enable.auto.commit": True}, "enable.auto.commit"),
    ("consumer", {**GROUP, "enable.auto.offset.store": "true"}, "enable.auto.offset.store"),
    ("consumer", {**GROUP, "isolation.level": "read_uncommitted"}, "isolation.level"),
    ("consumer", {**GROUP, "auto.offset.reset": "none"}, "auto.offset.reset"),
    ("consumer", BROKERS, "group.id"),
    ("consumer", {"group.id": "g"}, "bootstrap.servers"),
    ("transactional", {**BROKERS, "message.timeout.ms": 120_000}, "message.timeout.ms"),
    ("transactional", {**BROKERS, "transactional.id": "other"}, "transactional.id"),
]


@pytest.mark.parametrize(("client", "settings", "key"), REFUSED)
def test_unsafe_settings_are_refused_with_the_key_named(client: str, settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        if client == "producer":
            producer_config(settings)
        elif client == "consumer":
            consumer_config(settings)
        else:
            transactional_producer_config(settings, "processor-1")
    assert refused.value.key == key
    assert f"`{key}`" in _section(CONFIGURATION.read_text(), "Refused settings"), \
        f"`{key}` is refused by the code but not listed under 'Refused settings'"


def test_safe_settings_are_accepted_and_user_values_win() -> None:
    # The refusals above must not be the only outcome: safe values pass and are kept.
    cfg = producer_config({**BROKERS, "acks": -1, "linger.ms": 50, "delivery.timeout.ms": 60_000})
    assert (cfg["acks"], cfg["linger.ms"], cfg["message.timeout.ms"]) == (-1, 50, 60_000)
    assert consumer_config({**GROUP, "auto.offset.reset": "latest"})["auto.offset.reset"] == "latest"


def test_every_test_the_docs_cite_exists() -> None:
    cited = 0
    for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]:
        for path, node in CITED_PROOF.findall(page.read_text()):
            cited += 1
            source = ROOT / path
            assert source.is_file(), f"{page.name} cites {path}, which does not exist"
            name = node.split("::")[-1]
            assert re.search(rf"^\s*(async )?def {name}\(", source.read_text(), re.M), \
                f"{page.name} cites {path}::{node}, which is not a test in that file"
    assert cited > 0, "the docs cite no test at all"


def test_the_docs_site_builds_with_strict_checks(tmp_path: Path) -> None:
    """CI builds the MkDocs site with --strict: a broken link or a missing page fails the suite."""
    import shutil
    import subprocess
    import sys

    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs is part of the dev extra; install it with ./dev setup"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "guarantees" / "index.html").exists()
