"""vla-rl: improve robot VLA policies while they are deployed.

The app floor (CLI, dashboard, trainers, rounds, ``up``) sits in this package above everything else;
:mod:`vla_rl.core` is the ground floor beside the contracts in :mod:`vla_rl_client`, and
:mod:`vla_rl.hub` the registry floor. Which package may import which: docs/architecture.md.
"""

from vla_rl.core.version import __version__

__all__ = ["__version__"]
