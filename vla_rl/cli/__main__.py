"""``python -m vla_rl.cli``: the same as the ``vla-rl`` command."""

import sys

from vla_rl.cli import main

sys.exit(main())
