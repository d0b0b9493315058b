"""A consumer process whose handler applies a side effect, for the dedup crash tests to SIGKILL.

With a store, the effect and the confirmation of the record's dedup key commit in one inbox transaction
(a row in the SQLite store's own file, or HINCRBY in the Redis store's server), so a kill leaves both or
neither; `--store none` is the control: the same effect, committed alone, at least once. Effects are keyed
only by the payload, so a message applied twice shows as a count of 2. It exits by itself after `--idle`
seconds without records; SIGTERM stops it gracefully. `--status-file` publishes its progress (see
status.py) for the fault gates; its log (stderr) says what it was assigned, handled and committed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Message

from reliable_kafka.consumer import CommitPolicy, DedupPolicy, ReliableConsumer
from reliable_kafka.lab.programs.status import LOG_FORMAT, Progress
from reliable_kafka.testing.child_connection import connection_from_env

log = logging.getLogger("reliable_kafka.lab.member")

EFFECTS_TABLE = "effects"
"""SQLite table of effects, one row per application: (payload TEXT); no key, so doubles show."""
EFFECTS_HASH = "effects"
"""Redis hash of effects under the store's prefix: payload -> how many times it was applied."""


def _sqlite_effects(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # what the store uses: the control must not be slower for it
    conn.execute(f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (payload TEXT NOT NULL)")
    return conn


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", choices=["sqlite", "redis", "none"], required=True)
    ap.add_argument("--bootstrap", help="the brokers of an open cluster (default: from the environment)")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--db", help="SQLite file: the dedup store and its effects table (or the control's effects)")
    ap.add_argument("--redis-url")
    ap.add_argument("--redis-prefix", default="rk:dedup:")
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--instance-id")
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--handle-delay-s", type=float, default=0.0,
                    help="sleep after each effect: keeps the member mid-batch, where a pause catches it")
    ap.add_argument("--status-file", help="where to publish progress for the tests' fault gates")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    log.info("member of %s on %s starting (store %s, instance %s)", args.group, args.topic, args.store,
             args.instance_id)

    conf: dict[str, Any] = {**connection_from_env(args.bootstrap), "group.id": args.group,
                            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}
    if args.instance_id:
        conf["group.instance.id"] = args.instance_id
    last_record = [time.monotonic()]
    store: Any = None
    consumer: ReliableConsumer
    progress: Progress
    apply: Callable[[Message], None]

    if args.store == "sqlite":
        from reliable_kafka.dedup import SQLiteDedupStore

        _sqlite_effects(args.db).close()  # the effects table lives in the store's own file
        store = SQLiteDedupStore(args.db)

        def apply(msg: Message) -> None:
            with store.inbox([consumer.dedup_key_of(msg)]) as tx:
                tx.conn.execute(f"INSERT INTO {EFFECTS_TABLE} (payload) VALUES (?)", ((msg.value() or b"").decode(),))

    elif args.store == "redis":
        from reliable_kafka.dedup import RedisDedupStore

        store = RedisDedupStore(args.redis_url, prefix=args.redis_prefix)
        effects = args.redis_prefix + EFFECTS_HASH

        def apply(msg: Message) -> None:
            with store.inbox([consumer.dedup_key_of(msg)]) as tx:
                tx.pipe.hincrby(effects, msg.value(), 1)

    else:
        control = _sqlite_effects(args.db)

        def apply(msg: Message) -> None:
            control.execute(f"INSERT INTO {EFFECTS_TABLE} (payload) VALUES (?)", ((msg.value() or b"").decode(),))

    def handle(msg: Message) -> None:
        apply(msg)
        if args.handle_delay_s:
            time.sleep(args.handle_delay_s)
        progress.record(msg.partition(), msg.offset())  # type: ignore[arg-type]
        last_record[0] = time.monotonic()

    conf["on_commit"] = lambda err, tps: progress.on_commit(err, tps)
    dedup = DedupPolicy(store, lease_s=args.lease_s) if store is not None else None  # none: the control
    consumer = ReliableConsumer(conf, [args.topic], dedup=dedup, commit=CommitPolicy(interval_s=0.5))
    progress = Progress(args.status_file).start()
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())

    def idle_watch() -> None:
        while time.monotonic() - last_record[0] < args.idle:
            time.sleep(0.2)
        consumer.stop()

    threading.Thread(target=idle_watch, daemon=True).start()
    consumer.run(handle)
    progress.stop()  # its last figures, logged
    consumer.close()
    log.info("stopped: %s", consumer.stats())
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
