"""The batch queue of one model (server/batching.py): bounds, the batching wait (fixed and adaptive),
least-served connections first, and closing. No model, no gRPC: items and clocks only."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from server.batching import BatchQueue, _Pending
from vla_rl.core.rpc import RequestError


def _item(peer: str) -> _Pending:
    return _Pending(
        state=np.zeros(2, np.float32),
        cameras={},
        instruction="",
        seed=0,
        noise=None,
        deadline=None,
        enqueued_ns=time.perf_counter_ns(),
        peer=peer,
    )


def _queue(**kw: Any) -> BatchQueue:
    return BatchQueue("arm", **({"max_batch": 4, "max_wait_us": 0, "max_queue": 8} | kw))


def test_bounds_refuse_at_once_and_count() -> None:
    q = _queue(max_queue=3, max_peer_queued=2)
    q.submit(_item("a"))
    q.submit(_item("a"))
    with pytest.raises(RequestError, match="max_peer_queued") as err:
        q.submit(_item("a"))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    q.submit(_item("b"))
    with pytest.raises(RequestError, match="request queue full \\(3 waiting\\)"):
        q.submit(_item("c"))
    assert q.rejected_full == 2 and len(q) == 3 and q.active_clients() == 2
    with pytest.raises(ValueError, match="max_batch >= 1"):
        _queue(max_batch=0)


def test_take_waits_for_a_crowd_but_not_for_a_lone_robot() -> None:
    fixed = _queue(max_wait_us=200_000, adaptive_wait=False)
    fixed.submit(_item("a"))
    t0 = time.perf_counter()
    assert len(fixed.take() or []) == 1
    assert time.perf_counter() - t0 >= 0.15  # waited for others that never came
    adaptive = _queue(max_wait_us=2_000_000)
    adaptive.submit(_item("a"))
    t0 = time.perf_counter()
    assert len(adaptive.take() or []) == 1
    assert time.perf_counter() - t0 < 1.0  # every active connection is in the batch: go now
    adaptive.submit(_item("a"))
    adaptive.submit(_item("b"))
    adaptive.submit(_item("c"))
    adaptive.submit(_item("d"))
    adaptive.submit(_item("e"))
    assert len(adaptive.take() or []) == 4 and len(adaptive) == 1  # a full batch goes at once, max_batch


def test_least_served_first_when_more_wait_than_fit() -> None:
    q = _queue(max_batch=2)
    for peer in ("flood", "flood", "flood", "robot"):
        q.submit(_item(peer))
    assert [p.peer for p in q.take() or []] == ["flood", "flood"]  # FIFO among the never served
    assert [p.peer for p in q.take() or []] == ["flood", "robot"]  # fits: both go
    for peer in ("flood", "flood", "robot"):
        q.submit(_item(peer))
    assert [p.peer for p in q.take() or []] == ["flood", "robot"]  # robot served less than flood recently


def test_close_wakes_take_and_returns_what_waited() -> None:
    q = _queue()
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(q.take()))
    taker.start()
    time.sleep(0.05)
    assert q.close() == []
    taker.join(5)
    assert got == [None]  # the batcher thread ends
    q2 = _queue(max_wait_us=10_000_000, adaptive_wait=False)
    item = _item("a")
    q2.submit(item)
    assert q2.close() == [item] and q2.take() is None
    with pytest.raises(RequestError, match="shutting down"):
        q2.submit(_item("a"))


def test_claim_lone_only_for_the_one_active_connection_with_nothing_queued() -> None:
    q = _queue(activity_window_s=60.0)
    assert q.claim_lone("a") and q.active_clients() == 1  # counted as active (and served)
    assert q.claim_lone("a")
    assert not q.claim_lone("b")  # "a" is still active: b's request may get company
    q.submit(_item("a"))
    assert not q.claim_lone("a")  # something queued: it goes to the batcher
    assert [p.peer for p in q.take() or []] == ["a"]
    assert not _queue(adaptive_wait=False).claim_lone("a")  # a fixed wait is kept
    closed = _queue()
    closed.close()
    assert not closed.claim_lone("a")
