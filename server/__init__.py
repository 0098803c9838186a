"""gRPC policy server (:mod:`server.policy_server`), its slim clients (:mod:`vla_rl_client.policy_client`, asyncio:
:mod:`vla_rl_client.aio_policy_client`, their shared :mod:`vla_rl_client.policy_common`), the robot-side action-chunk queue
(:mod:`vla_rl_client.action_queue`) and wire codec.

Kept import-free so that ``import vla_rl_client.policy_client`` pulls in neither torch nor the model code: robots need
only numpy, grpcio, protobuf and Pillow. The dashboard will live here too.

The robot side ships on its own as ``vla-rl-client`` (like openpi's ``openpi-client``): the policy clients,
action queue, codec and stubs, ``vla_rl_client.spec`` and the fleet robot client (``vla_rl_client.robot_client``,
``vla_rl_client.wire``, ``vla_rl_client.meta``), with numpy, grpcio, protobuf and Pillow as its only dependencies::

    python -m scripts.build_client --out dist/      # in the repo root, with the dev venv
    pip install dist/vla_rl_client-0.1.0-py3-none-any.whl   # on the robot; [health] adds client.health()

``scripts/build_client.py`` lists its files; ``tests/test_imports.py`` keeps them importing nothing else
and ``tests/test_client_package.py`` drives a robot from a bare venv. Never install it next to ``vla-rl``.
"""
