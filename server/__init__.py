"""gRPC policy server (:mod:`server.policy_server`), its slim clients (:mod:`server.client`, asyncio:
:mod:`server.aio_client`, their shared :mod:`server.client_common`), the robot-side action-chunk queue
(:mod:`server.action_queue`) and wire codec.

Kept import-free so that ``import server.client`` pulls in neither torch nor the model code: robots need
only numpy, grpcio, protobuf and Pillow. The dashboard will live here too.

The robot side ships on its own as ``vla-rl-client`` (like openpi's ``openpi-client``): the policy clients,
action queue, codec and stubs, ``vla_rl.spec`` and the fleet robot client (``fleet.robot_client``,
``fleet.wire``, ``fleet.meta``), with numpy, grpcio, protobuf and Pillow as its only dependencies::

    python -m scripts.build_client --out dist/      # in the repo root, with the dev venv
    pip install dist/vla_rl_client-0.1.0-py3-none-any.whl   # on the robot; [health] adds client.health()

``scripts/build_client.py`` lists its files; ``tests/test_imports.py`` keeps them importing nothing else
and ``tests/test_client_package.py`` drives a robot from a bare venv. Never install it next to ``vla-rl``.
"""
