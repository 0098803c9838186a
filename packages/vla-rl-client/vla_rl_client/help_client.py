"""Robot side of the help queue: ask the collector for an operator, learn when one took the request.

    helper = HelpClient("127.0.0.1:50071", robot_id="arm-7", token=token)
    req = helper.ask(episode_id, "failure predictor: 0.83 > 0.61", urgency=0.83)
    ...                                     # keep going (or hold still) while waiting
    if helper.status(req.request_id).claimed:
        client.begin_segment("intervention", "human", reason=f"help: taken by {req.claimed_by}")
    helper.withdraw(req.request_id)         # no longer needed (the episode ended, it recovered)

The request lands in the metadata DB through the collector (``RequestHelp``); a person claims it on the
dashboard's help queue. Asking again for the same episode returns the same request. Every call is one
unary RPC bounded by ``timeout_s``; errors raise :class:`HelpError` with the collector's message (which
names the field it refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from vla_rl_client.proto import collector_pb2 as pb

__all__ = ["MAX_REASON_CHARS", "HelpClient", "HelpError", "HelpStatus"]

MAX_REASON_CHARS = 256
"""The longest ``reason`` the collector takes."""


class HelpError(RuntimeError):
    """A help call failed: ``code`` is the gRPC status, the message the collector's."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(f"{code.name if code else 'UNKNOWN'}: {message}")
        self.code = code


@dataclass(frozen=True)
class HelpStatus:
    """Where a help request stands (``status``: open | claimed | resolved | expired)."""

    request_id: int
    status: str
    claimed_by: str = ""
    claimed_at: float = 0.0
    note: str = ""

    @property
    def claimed(self) -> bool:
        """An operator took it: time to hand control over."""
        return self.status == "claimed"

    @property
    def closed(self) -> bool:
        return self.status in ("resolved", "expired")


def _status(s: pb.HelpState) -> HelpStatus:
    return HelpStatus(int(s.request_id), s.status, s.claimed_by, float(s.claimed_at), s.note)


class HelpClient:
    """Help-queue calls of one robot (see the module docstring). Thread-safe (a gRPC channel)."""

    def __init__(
        self, address: str, robot_id: str, *, token: str | None = None, timeout_s: float = 5.0
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        self.robot_id = robot_id
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(address)
        service = pb.DESCRIPTOR.services_by_name["Collector"].full_name
        self._ask = self._channel.unary_unary(
            f"/{service}/RequestHelp",
            request_serializer=pb.HelpAsk.SerializeToString,
            response_deserializer=pb.HelpState.FromString,
        )
        self._get = self._channel.unary_unary(
            f"/{service}/GetHelp",
            request_serializer=pb.HelpQuery.SerializeToString,
            response_deserializer=pb.HelpState.FromString,
        )

    def ask(self, episode_id: str, reason: str, urgency: float) -> HelpStatus:
        """Open a help request for ``episode_id`` (or get the one still open for it). ``reason``: one line,
        at most :data:`MAX_REASON_CHARS`; ``urgency``: bigger = sooner (finite)."""
        if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason: expected 1 to {MAX_REASON_CHARS} characters, got {reason!r}"[:300])
        if not math.isfinite(urgency):
            raise ValueError(f"urgency: expected a finite number, got {urgency!r}")
        ask = pb.HelpAsk(robot_id=self.robot_id, episode_id=episode_id, reason=reason, urgency=float(urgency))
        return self._call(self._ask, ask)

    def status(self, request_id: int) -> HelpStatus:
        """Where the request stands (poll it: ``.claimed`` says an operator took it)."""
        return self._call(self._get, pb.HelpQuery(request_id=request_id))

    def withdraw(self, request_id: int) -> HelpStatus:
        """The robot no longer needs help: the request is resolved (a closed one is returned as it is)."""
        return self._call(self._get, pb.HelpQuery(request_id=request_id, withdraw=True))

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> HelpStatus:
        try:
            return _status(method(request, timeout=self.timeout_s, metadata=self._metadata))
        except grpc.RpcError as e:
            raise HelpError(e.code(), e.details() or str(e)) from None  # type: ignore[attr-defined]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> HelpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
