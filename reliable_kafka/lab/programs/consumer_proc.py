"""A consumer process that the crash and rebalance tests SIGKILL or SIGTERM.

It appends each value it finished handling, with its rk-id, to a ledger file (one line, flushed), so the ledger
is exactly what was processed when it died. It exits by itself after `--idle` seconds without
records. SIGTERM asks the consumer to stop gracefully. `--status-file` publishes its progress (see
status.py) for the fault gates; its log (stderr) says what it was assigned, handled and committed, and
each step of a graceful stop. SIGUSR1 writes every thread's stack to the log (a test that finds a stopped
member still running asks for it before it gives up).
The connection settings come in the environment (see testing.child_connection), or --bootstrap alone.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import threading
import time

from confluent_kafka import Consumer, Message

from reliable_kafka.consumer import CommitPolicy, ReliableConsumer
from reliable_kafka.ids import message_id_of
from reliable_kafka.lab.programs.status import LOG_FORMAT, Progress
from reliable_kafka.testing.child_connection import connection_from_env

log = logging.getLogger("reliable_kafka.lab.member")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["reliable", "control"], required=True)
    ap.add_argument("--bootstrap", help="the brokers of an open cluster (default: from the environment)")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--instance-id")
    ap.add_argument("--idle", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--ready-file", help="created once SIGTERM is honoured, so a test never stops a member "
                                         "that is still importing (it would die of the default SIGTERM)")
    ap.add_argument("--status-file", help="where to publish progress for the tests' fault gates")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    # SIGTERM is honoured from here on, also before the consumer exists (a member stopped while starting).
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.ready_file:
        open(args.ready_file, "w").close()  # noqa: SIM115 - an empty marker

    ledger = open(args.ledger, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    conf = {**connection_from_env(args.bootstrap), "group.id": args.group, "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000}
    if args.instance_id:
        conf["group.instance.id"] = args.instance_id
    last_record = [time.monotonic()]
    progress: Progress

    def handle(msg: Message) -> None:
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        ledger.write(f"{(msg.value() or b'').decode()}\t{message_id_of(msg.headers()) or ''}\n")  # type: ignore[arg-type]
        progress.record(msg.partition(), msg.offset())  # type: ignore[arg-type]
        last_record[0] = time.monotonic()

    log.info("%s member of %s on %s starting (instance %s)", args.mode, args.group, args.topic, args.instance_id)
    if args.mode == "control":
        # The classic setup: auto-commit on a timer, offsets stored as soon as poll returns them.
        control = Consumer({**conf, "enable.auto.commit": True, "auto.commit.interval.ms": 100,
                            "auto.offset.reset": "earliest",
                            "on_commit": lambda err, tps: progress.on_commit(err, tps)})
        progress = Progress(args.status_file).start()
        control.subscribe([args.topic],
                          on_assign=lambda _, tps: log.info("assigned %s", [tp.partition for tp in tps]),
                          on_revoke=lambda _, tps: log.info("revoked %s", [tp.partition for tp in tps]))
        while time.monotonic() - last_record[0] < args.idle and not terminated.is_set():
            for msg in control.consume(num_messages=500, timeout=0.5):
                if msg.error() is None:
                    handle(msg)
        progress.stop()  # its last figures, logged
        control.close()
        log.info("stopped")
        return 0

    conf["on_commit"] = lambda err, tps: progress.on_commit(err, tps)
    consumer = ReliableConsumer(conf, [args.topic], concurrency=args.concurrency,
                                commit=CommitPolicy(interval_s=0.2))
    progress = Progress(args.status_file).start()

    def idle_watch() -> None:
        while time.monotonic() - last_record[0] < args.idle and not terminated.is_set():
            time.sleep(0.1)
        log.info("stopping (%s): finishing in-flight records", "SIGTERM" if terminated.is_set() else "idle")
        consumer.stop()

    threading.Thread(target=idle_watch, daemon=True).start()
    consumer.run(handle)
    log.info("run() returned; closing (final commit, leaving the group)")
    progress.stop()  # its last figures, logged
    consumer.close()
    log.info("stopped: %s", consumer.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
