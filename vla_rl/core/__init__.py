"""The ground floor of the vla-rl services: runtime pieces every layer above may use.

Above :mod:`vla_rl_client` (the contracts and robot-side clients) and below everything else: it imports
only :mod:`vla_rl_client`, the standard library, and grpc and protobuf (for :mod:`vla_rl.core.rpc`).
Holds the process lifeline (children exit with their parent), CPU scheduling, secrets from the
environment or files (and URLs shown without their password), the one check of text before it is stored,
console and structured logs, the seed ranges, a supervisor's instance nonces, a generic process supervisor
(:mod:`vla_rl.core.supervisor`), the version, and the shell our gRPC services share (:mod:`vla_rl.core.rpc`:
status errors, rate-limited per-peer warnings, undecodable bytes answered instead of raised, bearer-token
checks, SIGTERM -> drain).
"""
