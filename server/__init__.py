"""The gRPC policy server: dynamic batching across robots, several models, live checkpoint swaps.

Split by job (why it is built this way: :mod:`server.policy_server`):

* :mod:`server.config`: :class:`~server.config.ServerConfig`, every knob typed once (``vla-rl serve``'s
  flags, :func:`~server.policy_server.serve`'s and :class:`~server.policy_server.PolicyServer`'s input, a
  config file's content);
* :mod:`server.guard`: what a request may be: decoding an ``ActRequest`` with its checks, and the
  request size a robot spec needs;
* :mod:`server.batching`: pending requests, the bounded fair queue they wait in, the latency window;
* :mod:`server.slots`: hosted models (``ServedModel``, ``FlowPolicyModel`` / ``FlowVLAModel``, ``ServedVersion``) and a model
  id's ``ModelSlot`` (serving / previous / staged versions, swap, promote, rollback, its batcher thread);
* :mod:`server.service`: the ``vla_rl.v1.PolicyService`` servicer;
* :mod:`server.policy_server`: ``PolicyServer`` (load, follow, start, drain, stop) and ``serve()``.

What it shares with the fleet collector (status errors, rate-limited warnings, undecodable bytes, token
checks, SIGTERM -> drain) is :mod:`vla_rl.core.rpc`. The robot side (policy clients, action queue, codec,
stubs) is the separate ``vla_rl_client`` package; the web dashboard is :mod:`vla_rl.dashboard`.
"""
