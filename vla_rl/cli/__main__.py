"""``python -m vla_rl.cli``: the same as the ``vla-rl`` command."""

import sys

from vla_rl.core.lifeline import act_on_interrupt

act_on_interrupt()  # before the imports below: a SIGINT during them stops us even if we were born ignoring it

from vla_rl.cli import main  # noqa: E402

sys.exit(main())
