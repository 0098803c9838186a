"""vla-rl-client: what a robot needs to talk to vla-rl, and the contracts every side of vla-rl agrees on.

The bottom of vla-rl's layers: it imports nothing of vla-rl's and needs only numpy, grpcio, protobuf and
Pillow, so it installs alone on a robot (``pip install packages/vla-rl-client``) and the full ``vla-rl``
distribution depends on it.

Contracts (what crosses a process boundary):

- :mod:`vla_rl_client.spec`: the robot spec (cameras, state, action, control rate) and ``SpecError``
- :mod:`vla_rl_client.codec`: tensors and images to and from protobuf
- :mod:`vla_rl_client.proto`: the gRPC services (``policy_service.proto``, ``collector.proto``) and stubs
- :mod:`vla_rl_client.meta`: episode metadata types (controller, segment kinds, outcomes, episode ids)
- :mod:`vla_rl_client.frame`: ``Frame``, one recorded time step (what robots send and the store keeps)
- :mod:`vla_rl_client.wire`: frame and log-record framing for the collector

Clients (built only on the contracts):

- :mod:`vla_rl_client.policy_client`: ``PolicyClient``, the synchronous policy-server client (one server
  or balanced replicas); :mod:`vla_rl_client.aio_policy_client` its asyncio twin; both share
  :mod:`vla_rl_client.policy_common`
- :mod:`vla_rl_client.action_queue`: a steady action stream from chunks for a control loop
- :mod:`vla_rl_client.robot_client`: ``RobotClient``, streams episodes to the fleet collector

Importing this package imports nothing: ``import vla_rl_client.spec`` loads neither grpc nor Pillow.
"""

__version__ = "0.1.0"
