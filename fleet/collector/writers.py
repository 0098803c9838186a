"""Store writer handles: the collector's side of a store writer (a thread, or a ``fleet.store_writer`` process)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fleet.store_writer import DEFAULT_MAX_BUFFERED_BYTES, StoreWriter

log = logging.getLogger("vla_rl.collector")


class _WriterHandle:
    """One store writer, fed ops (see fleet/store_writer.py). Data ops are coalesced per episode (each
    says "the log is written up to byte B"), so a writer that falls behind gets one op per episode, not
    a growing queue; senders never block."""

    def __init__(self, on_report: Callable[[Mapping[str, Any]], None]) -> None:
        self._on_report = on_report
        self._cv = threading.Condition()
        self._data: dict[str, int] = {}
        self._ops: list[dict[str, Any]] = []

    def post_data(self, episode_id: str, end: int) -> None:
        with self._cv:
            self._data[episode_id] = max(end, self._data.get(episode_id, 0))
            self._cv.notify()

    def post(self, op: dict[str, Any]) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def _take(self) -> list[dict[str, Any]]:
        with self._cv:
            while not self._data and not self._ops:
                self._cv.wait()
            ops = [{"op": "data", "episode": e, "end": b} for e, b in self._data.items()] + self._ops
            self._data, self._ops = {}, []
        return ops

    def _report(self, r: Mapping[str, Any]) -> None:
        try:
            self._on_report(r)
        except Exception:  # a bookkeeping bug must not stop the writer's reports
            log.exception("could not handle a store writer report", extra={"report": dict(r)})

    def join(self, timeout_s: float) -> None:
        raise NotImplementedError


class _ThreadWriter(_WriterHandle):
    """The store writer in this process (``store_writers=0``: tests, debugging)."""

    def __init__(
        self,
        root: Path | str,
        fsync: bool,
        on_report: Callable[[Mapping[str, Any]], None],
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        wal_dir: Path | None = None,
    ) -> None:
        super().__init__(on_report)
        self._sw = StoreWriter(root, fsync, max_buffered_bytes, wal_dir=wal_dir)
        self._thread = threading.Thread(target=self._loop, name="collector-store", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            for op in self._take():
                for r in self._sw.handle(op):
                    self._report(r)
                if op["op"] == "stop":
                    return

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # past drain_timeout_s: stop between records (the log keeps the rest)
            log.error("store writer did not stop in time; abandoning its work (the log keeps it)")
            self._sw.aborted = True
            self._thread.join(1.0)


class _ProcessWriter(_WriterHandle):
    """A ``python -m fleet.store_writer`` process: JSON ops on its stdin, JSON reports on its stdout.

    It inherits the store lock, so no new collector can start writing the store while it still runs.
    """

    def __init__(
        self,
        index: int,
        root: Path | str,
        fsync: bool,
        lock_fd: int,
        on_report: Callable[[Mapping[str, Any]], None],
        on_exit: Callable[[_ProcessWriter], None],
        nice: int = 0,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        wal_dir: Path | None = None,
    ) -> None:
        super().__init__(on_report)
        self._on_exit = on_exit
        repo = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "fleet.store_writer", "--store", str(root), "--nice", str(nice)]
        cmd += ["--fsync"] if fsync else []
        cmd += ["--max-buffered-bytes", str(max_buffered_bytes)]
        cmd += ["--wal-dir", str(wal_dir)] if wal_dir is not None else []
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(lock_fd,), env=env
        )
        self._stopping = False
        name = f"collector-store-{index}"
        self._sender = threading.Thread(target=self._send_loop, name=name + "-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=name + "-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _send_loop(self) -> None:
        assert self.proc.stdin is not None
        while True:
            ops = self._take()
            try:
                self.proc.stdin.write(b"".join(json.dumps(op).encode() + b"\n" for op in ops))
                self.proc.stdin.flush()
            except OSError:  # the process is gone; the reader notices and a new one replays
                return
            if any(op["op"] == "stop" for op in ops):
                self._stopping = True
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                return

    def _read_loop(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                r = json.loads(line)
            except ValueError:
                log.error("store writer said something that is not a report", extra={"line": line[:200]})
                continue
            self._report(r)
        self.proc.wait()
        if not self._stopping or self.proc.returncode != 0:
            self._on_exit(self)

    def join(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error(
                "store writer did not stop within drain_timeout_s; killing it (the log keeps its work)",
                extra={"pid": self.proc.pid},
            )
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (tests: a writer dying mid-stream)."""
        self.proc.kill()
