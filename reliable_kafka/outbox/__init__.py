"""The crash-safe SQLite outbox behind ReliableProducer: Outbox (front.py) and the parts it composes.

Guarantee: a message appended is durable when append() returns and leaves the spool only through
mark_delivered() or an explicit purge(); a file that fails its checks is never touched.

Which file owns what:

- front.py: ``Outbox``, the thread lock around the parts, the bound (``max_messages``/``max_bytes``) and
  the running totals it is checked against, and the public operations that compose the parts below.
- file.py: opening a file for its owner or a read-only viewer, the connection, transactions, closing.
- lock.py: one owner per file (the flock on ``<outbox>.lock``, ``OutboxLocked``), and who owns it now.
- pool.py: the outbox pool of ``outbox_dir=``: numbered slot files in one directory, claiming a free one,
  finding the ones dead or retired processes left pending, and every slot's status.
- schema.py: the on-disk layout (documented there), the format marker and version, check / create /
  upgrade.
- sqlite_errors.py: SQLite failures as our errors (corrupt, read-only, full disk, I/O error).
- rows.py: the ``messages`` table's rows (headers encoding, NewMessage in, OutboxRow out) and its SQL.
- batches.py: the ``batches`` table and the in-memory view of its rows (which messages of a batch are
  confirmed), explode and the batch's share of the totals.
- journal.py: the accept journal of durability "process": single appends as records in memory-mapped
  segment files beside the outbox (no transaction), delivery records, and reading them back.

The types the outbox takes and returns (``NewMessage``, ``OutboxRow``, ``OutboxStats``, ``Durability``)
belong to the spool abstraction (reliable_kafka.spool) and are re-exported here for old imports.
"""

from reliable_kafka.errors import OutboxCorrupt, OutboxError, OutboxFull, OutboxLocked
from reliable_kafka.outbox.front import Outbox
from reliable_kafka.outbox.rows import FAILED, PENDING, decode_headers, encode_headers
from reliable_kafka.outbox.schema import FORMAT_MARKER, SCHEMA_VERSION
from reliable_kafka.spool import Durability, NewMessage, OutboxRow, OutboxStats

__all__ = [
    "FAILED",
    "FORMAT_MARKER",
    "PENDING",
    "SCHEMA_VERSION",
    "Durability",
    "NewMessage",
    "Outbox",
    "OutboxCorrupt",
    "OutboxError",
    "OutboxFull",
    "OutboxLocked",
    "OutboxRow",
    "OutboxStats",
    "decode_headers",
    "encode_headers",
]
