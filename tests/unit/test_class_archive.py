"""The Kafka node's class archive (testing/class_archive.py, testing/jars.py): where it lives, and which JVMs
map it or write it."""

from __future__ import annotations

from pathlib import Path

from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.jars import class_archive_options, class_archive_path


def _java(tmp_path: Path, name: str = "java", body: bytes = b"#!/bin/sh\n") -> str:
    java = tmp_path / "bin" / name
    java.parent.mkdir(parents=True, exist_ok=True)
    java.write_bytes(body)
    return str(java)


def test_the_archive_sits_beside_the_jars_and_is_named_after_the_java_runtime(tmp_path) -> None:
    libs, java = tmp_path / "kafka" / "libs", _java(tmp_path)
    one = class_archive_path(libs, java)
    assert one.parent == libs.parent / "class-archive" and one.suffix == ".jsa"
    assert class_archive_path(libs, java) == one  # stable for the same runtime
    assert class_archive_path(libs, _java(tmp_path / "other", body=b"#!/bin/sh\n# 17.0.9\n")) != one


def test_nodes_and_storage_runs_map_the_archive_only_once_it_is_built(tmp_path) -> None:
    libs, java = tmp_path / "libs", _java(tmp_path)
    assert class_archive_options(libs, java) == ()
    archive = class_archive_path(libs, java)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"cds")
    assert class_archive_options(libs, java) == (f"-XX:SharedArchiveFile={archive}",)


def test_only_the_node_of_a_building_cluster_writes_the_archive_at_exit(tmp_path, monkeypatch) -> None:
    java = _java(tmp_path)
    monkeypatch.setattr("reliable_kafka.testing.cluster.java_executable", lambda: java)
    partial = tmp_path / "partial.jsa"
    building = LocalKafkaCluster(brokers=1, archive_classes_to=partial)
    node = building._java_cmd(tmp_path / "libs", "kafka.Kafka", "server.properties", heap_mb=256)
    storage = building._java_cmd(tmp_path / "libs", "kafka.tools.StorageTool", "format", heap_mb=256)
    assert f"-XX:ArchiveClassesAtExit={partial}" in node
    assert not any(flag.startswith(("-XX:ArchiveClassesAtExit", "-XX:SharedArchiveFile")) for flag in storage)
