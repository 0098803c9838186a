"""What a robot of a simulated fleet did, as JSON lines: one line per frame (episode, seq, content hash,
controller, segment) and one per episode (length, segments, outcome), so a test can check the store
against the robots' own record. A synthetic robot writes both; a simulated robot writes its frames and
the sim fleet's driver the episode lines of the episodes it counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RobotRecord:
    """What a robot did, one JSON line per frame and per episode (None path = record nothing)."""

    def __init__(self, path: str | None, flush_frames: bool = False) -> None:
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - lives as long as the robot
        self._flush_frames = flush_frames

    def frame(self, episode: str, seq: int, digest: str, controller: int, segment: int) -> None:
        if self._f:
            self._f.write(
                json.dumps(
                    {
                        "episode": episode,
                        "seq": seq,
                        "digest": digest,
                        "controller": controller,
                        "segment": segment,
                    }
                )
                + "\n"
            )
            if self._flush_frames:  # a robot that can be killed mid-episode leaves what it did so far
                self._f.flush()

    def episode(self, episode: str, length: int, segments: list[dict[str, Any]], outcome: str) -> None:
        if self._f:
            self._f.write(
                json.dumps({"episode": episode, "length": length, "segments": segments, "outcome": outcome})
                + "\n"
            )
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def read_records(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Frame records and episode records (by id) from robots' JSON-lines files."""
    frames: list[dict[str, Any]] = []
    episodes: dict[str, dict[str, Any]] = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            rec = json.loads(line)
            if "seq" in rec:
                frames.append(rec)
            else:
                episodes[rec["episode"]] = rec
    return frames, episodes
