"""Fingerprint of a Spark partition's rows as the Kafka writer sees them (key, value, topic, partition, headers).

The digest depends only on the sequence of rows, never on how Spark cut them into Arrow batches, so a
retry can prove it is writing the same input as the attempt whose progress it resumes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Columns of Spark's Kafka sink that decide what is written; any other column is ignored by the sink.
WRITTEN_COLUMNS = ("key", "value", "topic", "partition", "headers")


def _lengths(column: pa.Array) -> bytes:
    """Per-row byte lengths, -1 for null: makes the concatenated data unambiguous."""
    lengths = pc.binary_length(column).cast(pa.int64()).fill_null(-1)
    return bytes(lengths.to_numpy(zero_copy_only=False).tobytes())


class Fingerprint:
    """An incremental, batch-boundary independent digest of rows.

    Each column feeds two independent hash streams (row lengths, row bytes): a stream is a plain
    concatenation, so splitting the rows differently into batches cannot change it.
    """

    def __init__(self, seed: str = "") -> None:
        self._streams: dict[str, Any] = {}
        self._seed = seed
        self.rows = 0

    def _stream(self, name: str) -> Any:
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = hashlib.blake2b(digest_size=16)
        return stream

    def update(self, batch: pa.RecordBatch) -> None:
        """Add the rows of `batch` (only the columns the sink writes count)."""
        names = set(batch.schema.names)
        for name in WRITTEN_COLUMNS:
            if name not in names:
                continue
            column = batch.column(name)
            if name in ("key", "value", "topic"):
                self._stream(f"{name}.len").update(_lengths(column))
                self._stream(f"{name}.data").update(_data(column))
            elif name == "partition":
                ints = column.cast(pa.int64()).fill_null(-1)
                self._stream(name).update(bytes(ints.to_numpy(zero_copy_only=False).tobytes()))
            else:  # headers: rare and nested; one framed repr per row keeps the stream row-separable
                stream = self._stream(name)
                for row in column.to_pylist():
                    text = repr(row).encode()
                    stream.update(len(text).to_bytes(8, "little") + text)
        self.rows += batch.num_rows

    def digest(self) -> str:
        """The digest of every row added so far (rows added later do not change a returned value)."""
        total = hashlib.blake2b(digest_size=16)
        total.update(self._seed.encode())
        total.update(self.rows.to_bytes(8, "little"))
        for name in sorted(self._streams):
            total.update(name.encode())
            total.update(self._streams[name].copy().digest())
        return total.hexdigest()


def _data(column: pa.Array) -> bytes | memoryview:
    """The concatenated bytes of the non-null rows of a binary or string column."""
    if len(column) == 0:
        return b""
    if column.null_count == 0:
        # Zero copy: the rows are one contiguous range of the data buffer, between the first and
        # the last offset of this (possibly sliced) array.
        _validity, offsets_buf, data_buf = column.buffers()[:3]
        wide = pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
        offsets = np.frombuffer(offsets_buf, dtype=np.int64 if wide else np.int32)
        start, end = int(offsets[column.offset]), int(offsets[column.offset + len(column)])
        return memoryview(data_buf)[start:end] if data_buf is not None else b""
    # A null slot may still own bytes in Arrow's layout: go through Python values to skip them.
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.binary() if pa.types.is_string(column.type) else pa.large_binary())
    return b"".join(v for v in column.to_pylist() if v)
