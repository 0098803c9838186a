"""Robot side of the help queue: ask the collector for an operator, learn when one took the request.

    helper = HelpClient("127.0.0.1:50071", robot_id="arm-7", token=token)
    req = helper.ask(episode_id, "failure predictor: 0.83 > 0.61", urgency=0.83)
    ...                                     # keep going (or hold still) while waiting
    if helper.status(req.request_id).claimed:
        client.begin_segment("intervention", "human", reason=f"help: taken by {req.claimed_by}")
    helper.withdraw(req.request_id)         # no longer needed (the episode ended, it recovered)

The request lands in the metadata DB through the collector (``RequestHelp``); a person claims it on the
dashboard's help queue, a program acting as an operator (the simulated operators of ``vla-rl fleet sim``)
through :class:`OperatorClient` with the collector's shared credential:

    desk = OperatorClient("127.0.0.1:50071", "sim-operator-0", token=shared_token)
    req = desk.claim_next()                 # the most urgent open request, or None
    ...                                     # the robot sees it claimed and hands over; drive it
    desk.resolve(req.request_id, "drove 15 steps")

Asking again for the same episode returns the same request. Every call is one unary RPC bounded by
``timeout_s``; errors raise :class:`HelpError` with the collector's message (which names the field it
refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from vla_rl_client.proto import collector_pb2 as pb

__all__ = ["MAX_REASON_CHARS", "HelpClient", "HelpError", "HelpStatus", "OperatorClient"]

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
    robot_id: str = ""
    episode_id: str = ""
    urgency: float = 0.0
    created_at: float = 0.0

    @property
    def claimed(self) -> bool:
        """An operator took it: time to hand control over."""
        return self.status == "claimed"

    @property
    def closed(self) -> bool:
        return self.status in ("resolved", "expired")


def _status(s: pb.HelpState) -> HelpStatus:
    return HelpStatus(
        int(s.request_id),
        s.status,
        s.claimed_by,
        float(s.claimed_at),
        s.note,
        s.robot_id,
        s.episode_id,
        float(s.urgency),
        float(s.created_at),
    )


class _Calls:
    """A channel to the collector and its bearer credential; one unary call at a time per method."""

    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(address)
        self._service = pb.DESCRIPTOR.services_by_name["Collector"].full_name

    def method(self, name: str, request_type: type) -> grpc.UnaryUnaryMultiCallable:
        return self._channel.unary_unary(
            f"/{self._service}/{name}",
            request_serializer=request_type.SerializeToString,  # type: ignore[attr-defined]
            response_deserializer=pb.HelpState.FromString,
        )

    def call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> HelpStatus:
        try:
            return _status(method(request, timeout=self.timeout_s, metadata=self._metadata))
        except grpc.RpcError as e:
            raise HelpError(e.code(), e.details() or str(e)) from None  # type: ignore[attr-defined]

    def close(self) -> None:
        self._channel.close()


class HelpClient:
    """Help-queue calls of one robot (see the module docstring). Thread-safe (a gRPC channel)."""

    def __init__(
        self, address: str, robot_id: str, *, token: str | None = None, timeout_s: float = 5.0
    ) -> None:
        self._calls = _Calls(address, token, timeout_s)
        self.robot_id = robot_id
        self.timeout_s = timeout_s
        self._ask = self._calls.method("RequestHelp", pb.HelpAsk)
        self._get = self._calls.method("GetHelp", pb.HelpQuery)

    def ask(self, episode_id: str, reason: str, urgency: float) -> HelpStatus:
        """Open a help request for ``episode_id`` (or get the one still open for it). ``reason``: one line,
        at most :data:`MAX_REASON_CHARS`; ``urgency``: bigger = sooner (finite)."""
        if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON_CHARS:
            raise ValueError(f"reason: expected 1 to {MAX_REASON_CHARS} characters, got {reason!r}"[:300])
        if not math.isfinite(urgency):
            raise ValueError(f"urgency: expected a finite number, got {urgency!r}")
        ask = pb.HelpAsk(robot_id=self.robot_id, episode_id=episode_id, reason=reason, urgency=float(urgency))
        return self._calls.call(self._ask, ask)

    def status(self, request_id: int) -> HelpStatus:
        """Where the request stands (poll it: ``.claimed`` says an operator took it)."""
        return self._calls.call(self._get, pb.HelpQuery(request_id=request_id))

    def withdraw(self, request_id: int) -> HelpStatus:
        """The robot no longer needs help: the request is resolved (a closed one is returned as it is)."""
        return self._calls.call(self._get, pb.HelpQuery(request_id=request_id, withdraw=True))

    def close(self) -> None:
        self._calls.close()

    def __enter__(self) -> HelpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OperatorClient:
    """Help-queue calls of one operator (see the module docstring): claim, poll, resolve. The collector
    accepts them only with its shared credential. Thread-safe (a gRPC channel)."""

    def __init__(
        self, address: str, operator: str, *, token: str | None = None, timeout_s: float = 5.0
    ) -> None:
        if not isinstance(operator, str) or not operator.strip():
            raise ValueError(f"operator: expected a non-empty name, got {operator!r}")
        self._calls = _Calls(address, token, timeout_s)
        self.operator = operator
        self._claim = self._calls.method("ClaimHelp", pb.HelpClaim)
        self._resolve = self._calls.method("ResolveHelp", pb.HelpResolve)
        self._get = self._calls.method("GetHelp", pb.HelpQuery)

    def claim(self, request_id: int) -> HelpStatus:
        """Take this request (HelpError FAILED_PRECONDITION: it is not open, the message says who has it)."""
        return self._calls.call(self._claim, pb.HelpClaim(operator=self.operator, request_id=request_id))

    def claim_next(self) -> HelpStatus | None:
        """Take the most urgent (then oldest) open request; None when nothing is open."""
        try:
            return self._calls.call(self._claim, pb.HelpClaim(operator=self.operator))
        except HelpError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def status(self, request_id: int) -> HelpStatus:
        """Where the request stands."""
        return self._calls.call(self._get, pb.HelpQuery(request_id=request_id))

    def resolve(self, request_id: int, note: str = "") -> HelpStatus:
        """Close a request this operator claimed (``note``: what was done, one line)."""
        done = pb.HelpResolve(operator=self.operator, request_id=request_id, note=note)
        return self._calls.call(self._resolve, done)

    def close(self) -> None:
        self._calls.close()

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
