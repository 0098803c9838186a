"""Store writers: turn the collector's write-ahead logs into Zarr, in their own process(es).

The collector acknowledges a message once it is in the episode's log (``<store>/wal/<episode>.wal``).
Writing it into the Zarr arrays (compressing camera chunks) is done here. In the collector's process that
work and the intake shared one core (the GIL): at 16 robots x 30 Hz the collector's core was full and acks
queued for seconds (measured: docs/store.md, Durability: log first, then Zarr). A writer process runs on
the other core.

The hand-off is the log itself. The collector sends only small JSON lines, never frame data (nothing is
pickled):

* ``{"op": "data", "episode": E, "end": B}``: the log of E is written up to byte B; apply it. The first
  one for an episode resumes it from its ``commit.json`` and replays its log from the start, skipping
  what Zarr already has, exactly as recovery after a crash does (a writer that is restarted needs nothing
  else).
* ``{"op": "flush", "episode": E}``: write and commit E's buffered frames (idle episodes).
* ``{"op": "stop"}``: flush every open episode, then exit.

and gets back one line per op: ``{"episode": E, "applied": B, "stored": N, "closed": bool,
"error": str | null}`` (``stored`` = frames committed in Zarr). When an episode's ``end`` record has
been applied, the episode is closed in the store; the collector then records it in the metadata DB and
deletes the log. Zarr is authoritative through ``commit.json``, so a writer killed at any point loses
nothing: the next one resumes from the commit and replays the log, and no frame is written twice.

``python -m fleet.store_writer --store PATH`` is the process; :class:`StoreWriter` is the same work
in-process (a collector with ``store_writers=0`` runs it in a thread). With an object store
(``--store s3://bucket/prefix --wal-dir DIR``) the logs stay in the local ``DIR``, only whole chunks are
uploaded (an idle episode's partial chunk waits in its log, see ``handle``), and an unreachable endpoint
is retried like a full disk.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client import wire

from fleet.store import EpisodeStore, EpisodeWriter
from fleet.store.layout import _BLOCKS, block_bytes
from fleet.wal import SEGMENT_KINDS, WAL_DIR, WriteAheadLog, decode_frames, parse_message
from vla_rl.core.scheduling import leave_realtime


def _slice_frames(batch: Mapping[str, Any], skip: int) -> dict[str, Any]:
    """Drop the first ``skip`` frames of a decoded batch (they are stored already)."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k == "cameras":
            out[k] = {c: a[skip:] for c, a in v.items()}
        elif isinstance(v, list | np.ndarray):
            out[k] = v[skip:]
        else:
            out[k] = v
    return out


def apply_record(w: EpisodeWriter, raw: bytes) -> bool:
    """Feed one logged message to the episode's writer (idempotent against what the writer has).

    Returns True when it was the episode's end (the writer is closed then).
    """
    msg, cams = parse_message(raw)
    body = msg.WhichOneof("body")
    if body == "segment":
        sm = msg.segment
        if sm.index < len(w.segments):
            return False
        if sm.index != len(w.segments) or sm.start != w.num_frames:
            raise RuntimeError(f"segment {sm.index} at {sm.start} does not follow the writer's state")
        w.begin_segment(SEGMENT_KINDS[sm.kind], int(sm.controller), sm.reason or None)
    elif body == "frames":
        fb = msg.frames
        n = int(fb.action.shape[0])
        skip = w.num_frames - fb.seq
        if skip >= n:
            return False  # in Zarr already: skip without decoding the pixels
        if skip < 0:
            raise RuntimeError(f"frames from {fb.seq} leave a gap after {w.num_frames}")
        batch = decode_frames(fb, w.spec, max(n, 1), -math.inf, cams)
        w.add_frames(_slice_frames(batch, skip) if skip else batch)
    elif body == "end":
        e = msg.end
        w.close(outcome=e.outcome, success=e.success if e.HasField("success") else None)
        return True
    return False


# OS errors that pass (space or descriptors freed): the episode is retried, not failed.
RETRYABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE})
DEFAULT_MAX_BUFFERED_BYTES = 1024 * 1024 * 1024


# An object store that cannot be reached (botocore / aiohttp names; no import needed to recognise them).
RETRYABLE_NETWORK_ERRORS = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
    }
)


def retryable(e: BaseException) -> bool:
    """An OS error (anywhere in its cause chain) that a retry after a while can get past: space or
    descriptors freed, or an object store that could not be reached."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in RETRYABLE_ERRNOS:
            return True
        if (
            isinstance(seen, ConnectionError | TimeoutError)
            or type(seen).__name__ in RETRYABLE_NETWORK_ERRORS
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass
class _Open:
    writer: EpisodeWriter
    offset: int = 0  # log bytes applied


def _buffered(w: EpisodeWriter) -> int:
    """Bytes an episode writer holds in memory (its chunk blocks)."""
    return sum(a.nbytes for a in w._pending.values())


class StoreWriter:
    """Applies the logs of the episodes it is told about (see the module docstring for the ops).

    It holds at most ``max_buffered_bytes`` of frame blocks in all: past it, the least recently used
    episodes are flushed into Zarr and let go (reopened from their commit when their log grows). No log
    stays open between ops (one descriptor at a time, however many episodes are open).
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        fsync: bool = False,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        *,
        wal_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        # No metadata DB here: the collector records closed episodes (one writer of the DB).
        self.store = EpisodeStore(store, fsync=fsync, cache_dir="off")
        self.wal_dir = Path(wal_dir) if wal_dir is not None else self.store.root / WAL_DIR
        self.max_buffered_bytes = max_buffered_bytes
        self.open: collections.OrderedDict[str, _Open] = collections.OrderedDict()  # LRU first
        self.resume_at: dict[str, int] = {}  # log offset of an episode let go cleanly (all flushed)
        self.failed: dict[str, str] = {}
        self.evicted = 0
        self.aborted = False  # the collector gave up waiting (drain_timeout_s): stop between records

    def handle(self, op: Mapping[str, Any]) -> list[dict[str, Any]]:
        kind = op.get("op")
        if self.aborted:
            return []
        if kind == "stop":
            return [self._run(eid, flush=True) for eid in list(self.open)]
        eid = str(op["episode"])
        if kind == "data":
            return [self._run(eid, end=int(op["end"]))]
        if kind == "flush":
            # An idle episode's partial chunk: on an object store, uploading it now and again when it
            # fills costs a read-modify-write of every array; the log holds the frames meanwhile, so
            # an object store gets whole chunks only (and the last one at the episode's end).
            return [self._run(eid, flush=self.store.remote is None)]
        raise ValueError(f"op: expected data, flush or stop, got {kind!r}")

    def _run(self, eid: str, end: int | None = None, flush: bool = False) -> dict[str, Any]:
        report: dict[str, Any] = {"episode": eid, "applied": 0, "stored": 0, "closed": False, "error": None}
        if eid in self.failed:
            report["error"] = self.failed[eid]
            return report
        try:
            ep = self.open.get(eid)
            if ep is None:
                meta = self.store.read_metadata(eid)
                if meta.is_closed:  # closed by a writer that died before it could say so
                    report.update(applied=end or 0, stored=meta.length, closed=True)
                    return report
                # Room for the block it is about to hold, before it is allocated.
                self._bound_buffers(keep=None, room=block_bytes(meta.spec, meta.chunk_len))
                writer = self.store.resume_episode(eid)
                ep = self.open[eid] = _Open(writer, self.resume_at.pop(eid, 0))
            self.open.move_to_end(eid)
            closed = False
            if end is not None and end > ep.offset:
                # One record in memory at a time: a writer far behind (the log holds up to max_pending_mb)
                # read the whole backlog at once, and a copy of each record besides.
                for raw in WriteAheadLog.records(self.wal_dir / f"{eid}.wal", ep.offset, end):
                    if self.aborted:
                        return report
                    closed = apply_record(ep.writer, raw) or closed
                    ep.offset += wire.RECORD_HEAD.size + len(raw)
            if flush and not closed:
                ep.writer.flush()
            report.update(applied=ep.offset, stored=ep.writer.committed, closed=closed)
            if closed:
                del self.open[eid]  # its blocks went to the block pool, which the bound counts
            self._bound_buffers(keep=None if closed else eid)
        except Exception as e:  # a store failure must not stop the other episodes; the log keeps the data
            report["error"] = f"{type(e).__name__}: {e}"
            # Its writer's state is unknown now: drop it, the next op resumes from the Zarr commit and
            # replays the log (what is committed is skipped).
            self.open.pop(eid, None)
            self.resume_at.pop(eid, None)
            if retryable(e):
                report["retry"] = True  # the collector asks again after a backoff
            else:
                self.failed[eid] = report["error"]
        return report

    def held_bytes(self) -> int:
        """Frame blocks this writer holds: the open episodes' and the free ones kept for reuse (a closed
        episode's blocks wait in the store's block pool for the next episode)."""
        return sum(_buffered(o.writer) for o in self.open.values()) + _BLOCKS.held_bytes

    def _bound_buffers(self, keep: str | None, room: int = 0) -> None:
        """Keep the blocks held (and ``room`` more, about to be taken) within the bound: first drop the free
        blocks kept for reuse, then flush and let go of the least recently used episodes."""
        total = sum(_buffered(o.writer) for o in self.open.values()) + room
        if total + _BLOCKS.held_bytes <= self.max_buffered_bytes:
            return
        _BLOCKS.clear()
        for eid in list(self.open):
            if total <= self.max_buffered_bytes:
                return
            if eid == keep:
                continue
            o = self.open.pop(eid)
            total -= _buffered(o.writer)
            self.evicted += 1
            try:
                o.writer.flush()  # committed in Zarr: resuming from the commit gives back this state
            except Exception:  # not committed: the next op replays its log from the start
                continue
            self.resume_at[eid] = o.offset


def main(argv: list[str] | None = None) -> int:
    """The writer process: ops on stdin, reports on stdout, one JSON object per line."""
    p = argparse.ArgumentParser(prog="python -m fleet.store_writer", description=__doc__)
    p.add_argument("--store", required=True, help="episode store: a directory or s3://bucket/prefix")
    p.add_argument(
        "--wal-dir", type=Path, default=None, help="the collector's write-ahead logs (default <store>/wal)"
    )
    p.add_argument("--fsync", action="store_true")
    p.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=DEFAULT_MAX_BUFFERED_BYTES,
        help="frame blocks held in memory, all episodes together (past it idle ones are flushed)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower this process's CPU priority by this much (the collector passes 10: see Collector)",
    )
    args = p.parse_args(argv)
    leave_realtime("fleet.store_writer")
    if args.nice:
        # Before any thread starts: Linux niceness is per thread and new threads inherit it.
        os.nice(args.nice)
    from vla_rl_client.wire import keep_freed_memory

    keep_freed_memory()
    sw = StoreWriter(
        args.store, fsync=args.fsync, max_buffered_bytes=args.max_buffered_bytes, wal_dir=args.wal_dir
    )
    out = sys.stdout
    for line in sys.stdin:
        op = json.loads(line)
        reports = sw.handle(op)
        for r in reports:
            out.write(json.dumps(r) + "\n")
        out.flush()
        if op.get("op") == "stop":
            return 0
    # stdin closed without "stop": the collector is gone (killed). Write nothing more: a new collector
    # replays the logs, and it must not find this process still writing (it holds the store lock).
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
