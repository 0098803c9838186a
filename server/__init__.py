"""gRPC policy server (:mod:`server.policy_server`), its slim clients (:mod:`server.client`, asyncio:
:mod:`server.aio_client`, their shared :mod:`server.client_common`), the robot-side action-chunk queue
(:mod:`server.action_queue`) and wire codec.

Kept import-free so that ``import server.client`` pulls in neither torch nor the model code: robots need
only numpy, grpcio and Pillow. The dashboard will live here too.
"""
