"""What the disk allows durability "fsync": syncs per second from 1 to 32 files synced at once, no brokers.

    python benchmarks/parallel_fdatasync.py [--out PATH] [DIR] > out.txt

Each of K threads owns one preallocated file in DIR (default: this checkout's directory, the disk an
outbox beside it would use) and, SYNCS / K times, writes 200 bytes at its next offset and `fdatasync()`s
that file (the GIL is released in both calls). Then the same with K threads sharing one file, each
record's copy into a shared mapping under a lock, as the accept journal stores it. Printed per K: syncs
per second, the wall time of one thread's sync, and the process's CPU per sync; every figure goes to PATH
(default benchmarks/results/journal/parallel-fdatasync.json).

Why: a thread that calls send() in "fsync" waits until its message is on the disk, so 16 threads have at
most 16 messages waiting, and a design's rate is 16 / (the time one of them waits). The group commit
syncs one transaction at a time; whether syncs of separate files proceed side by side decides whether a
sync lane per sender could go faster.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "journal" / "parallel-fdatasync.json"
SYNCS = 32_000
RECORD = b"x" * 200
FILE_BYTES = 16 << 20


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, FILE_BYTES)
    os.fsync(fd)  # the allocation on the disk first: what is timed is the data syncs only
    return fd


def _timed(threads: list[threading.Thread], syncs: int) -> dict[str, float]:
    cpu, start = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    return {"syncs_per_s": syncs / took, "wait_us": took / (syncs / len(threads)) * 1e6,
            "cpu_us_per_sync": (time.process_time() - cpu) / syncs * 1e6}


def own_files(folder: Path, k: int) -> dict[str, float]:
    """K threads, a file each: pwrite + fdatasync of its own file."""
    per = SYNCS // k
    fds = [_open(folder / f"own-{k}-{i}") for i in range(k)]

    def body(fd: int) -> None:
        for i in range(per):
            os.pwrite(fd, RECORD, i * len(RECORD))
            os.fdatasync(fd)

    try:
        return _timed([threading.Thread(target=body, args=(fd,)) for fd in fds], per * k)
    finally:
        for fd in fds:
            os.close(fd)


def one_file(folder: Path, k: int) -> dict[str, float]:
    """K threads, one shared mapped file: the record copied under a lock, then fdatasync of the file."""
    per = SYNCS // k
    fd = _open(folder / f"shared-{k}")
    mapped = mmap.mmap(fd, FILE_BYTES, flags=mmap.MAP_SHARED)
    lock, pos = threading.Lock(), [0]

    def body() -> None:
        for _ in range(per):
            with lock:
                at = pos[0]
                pos[0] = at + len(RECORD)
                mapped[at:at + len(RECORD)] = RECORD
            os.fdatasync(fd)

    try:
        return _timed([threading.Thread(target=body) for _ in range(k)], per * k)
    finally:
        mapped.close()
        os.close(fd)


def main() -> None:
    argv = sys.argv[1:]
    out_path = OUT
    if argv[:1] == ["--out"]:
        out_path, argv = Path(argv[1]), argv[2:]
    where = Path(argv[0]) if argv else Path(__file__).resolve().parent
    results: dict[str, dict[int, dict[str, float]]] = {"own_files": {}, "one_file": {}}
    with tempfile.TemporaryDirectory(dir=where, prefix="rk-fdatasync-") as d:
        for name, run in (("own_files", own_files), ("one_file", one_file)):
            for k in (1, 2, 4, 8, 16, 32):
                r = results[name][k] = run(Path(d), k)
                print(f"{name:9} {k:2} thread(s): {r['syncs_per_s']:8,.0f} syncs/s, a sync waits "
                      f"{r['wait_us']:5.0f} us, CPU {r['cpu_us_per_sync']:5.1f} us a sync", flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"syncs": SYNCS, "record_bytes": len(RECORD), "results": results}, indent=1))


if __name__ == "__main__":
    main()
