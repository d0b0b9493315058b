"""librdkafka's own property table, asked without creating a client: is a name a property, is a value valid.

It asks the very librdkafka that confluent-kafka runs (rd_kafka_conf_set on a throwaway configuration
object, which connects nowhere and opens no file), so the answer is exactly what a client would say.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# rd_kafka_conf_res_t (rdkafka.h)
_CONF_UNKNOWN = -2
_CONF_INVALID = -1
_ERRSTR_SIZE = 512

# Keys that confluent-kafka's Python client handles itself and never hands to librdkafka.
PYTHON_CLIENT_KEYS = frozenset({
    "error_cb", "throttle_cb", "stats_cb", "oauth_cb", "logger", "on_delivery", "on_commit",
    "default.topic.config",
})
# Setting these loads code into the asking process (interceptor plugins): known names, values not tried.
_NOT_TRIED = frozenset({"plugin.library.paths"})


def find_librdkafka() -> str | None:
    """Path of the librdkafka inside the confluent-kafka wheel, else a system librdkafka, else None."""
    spec = importlib.util.find_spec("confluent_kafka")
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        # Linux wheels vendor it next to the package (auditwheel), macOS wheels inside it (delocate).
        candidates = sorted(package_dir.parent.glob("confluent_kafka.libs/librdkafka*.so*"))
        candidates += sorted(package_dir.glob(".dylibs/librdkafka*.dylib"))
        if candidates:
            return str(candidates[0])
    return ctypes.util.find_library("rdkafka")


@dataclass(frozen=True)
class Refusal:
    """What librdkafka said about one setting."""

    key: str
    unknown: bool  # True: no such property; False: the value is invalid
    message: str


class PropertyTable:
    """The property table of one loaded librdkafka (thread safe: every check uses its own conf object)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        p, s = ctypes.c_void_p, ctypes.c_char_p
        lib.rd_kafka_version.restype = ctypes.c_int
        lib.rd_kafka_version_str.restype = s
        lib.rd_kafka_conf_new.restype = p
        lib.rd_kafka_conf_new.argtypes = []
        lib.rd_kafka_conf_set.restype = ctypes.c_int
        lib.rd_kafka_conf_set.argtypes = [p, s, s, s, ctypes.c_size_t]
        lib.rd_kafka_conf_destroy.restype = None
        lib.rd_kafka_conf_destroy.argtypes = [p]
        self._lib = lib
        self.version: int = lib.rd_kafka_version()
        self.version_str: str = lib.rd_kafka_version_str().decode()
        self._names: list[str] | None = None

    def check(self, settings: Mapping[str, Any]) -> list[Refusal]:
        """Every setting librdkafka refuses, in the order given (an empty list: all accepted)."""
        refused = []
        conf = self._lib.rd_kafka_conf_new()
        errstr = ctypes.create_string_buffer(_ERRSTR_SIZE)
        try:
            for key, value in settings.items():
                if key in PYTHON_CLIENT_KEYS or not isinstance(value, (str, int, float, bool)):
                    continue
                if key in _NOT_TRIED:
                    continue
                text = str(value).lower() if isinstance(value, bool) else str(value)
                res = self._lib.rd_kafka_conf_set(conf, key.encode(), text.encode(), errstr, _ERRSTR_SIZE)
                if res in (_CONF_UNKNOWN, _CONF_INVALID):
                    refused.append(Refusal(key, res == _CONF_UNKNOWN, errstr.value.decode(errors="replace")))
        finally:
            self._lib.rd_kafka_conf_destroy(conf)
        return refused

    def names(self) -> list[str]:
        """Every property name, aliases included: librdkafka's own CONFIGURATION.md, printed by this library."""
        if self._names is None:
            self._names = [line.split("|", 1)[0].strip() for line in self._properties_show().splitlines()
                           if "|" in line and not line.startswith(("Property ", "---"))]
        return self._names

    def _properties_show(self) -> str:
        # rd_kafka_conf_properties_show() writes to a C FILE*: an anonymous temporary file, read back.
        libc = ctypes.CDLL(None)
        libc.tmpfile.restype = ctypes.c_void_p
        libc.tmpfile.argtypes = []
        libc.fflush.argtypes = [ctypes.c_void_p]
        libc.fileno.argtypes = [ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        self._lib.rd_kafka_conf_properties_show.restype = None
        self._lib.rd_kafka_conf_properties_show.argtypes = [ctypes.c_void_p]
        handle = libc.tmpfile()
        if not handle:
            return ""
        try:
            self._lib.rd_kafka_conf_properties_show(handle)
            libc.fflush(handle)
            fd = libc.fileno(handle)
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            libc.fclose(handle)
        return b"".join(chunks).decode(errors="replace")


@lru_cache(maxsize=1)
def _table() -> PropertyTable | None:
    import confluent_kafka

    path = find_librdkafka()
    wanted = confluent_kafka.libversion()[1]
    if path is None:
        log.warning("librdkafka not found next to confluent-kafka: kafka.* settings are checked only when a "
                    "client starts")
        return None
    table = PropertyTable(path)
    if table.version != wanted:
        # A source build of confluent-kafka against another librdkafka: its table could differ.
        log.warning("found librdkafka %s at %s, but confluent-kafka runs %s: kafka.* settings are checked only "
                    "when a client starts", table.version_str, path, confluent_kafka.libversion()[0])
        return None
    return table


def property_table() -> PropertyTable | None:
    """The property table of the librdkafka confluent-kafka runs, or None when it cannot be loaded."""
    return _table()
