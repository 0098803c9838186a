"""The ``vla-rl`` command line: one table of commands, each a dataclass parsed by tyro and a function.

    vla-rl [--log-format text|json] [--log-level L] [--hub URL] COMMAND [SUBCOMMAND] [FLAGS]

A command's flags are its dataclass's fields (kebab-case), its ``--help`` their docstrings; the trainers'
are their config dataclasses themselves (``vla-rl train qam`` = :class:`~vla_rl.train.qam.QAMConfig`).
Bad flags or values exit 2 with a message naming the flag; expected mistakes at run time (a missing
store, an unknown task) print one ``error:`` line with how to fix it, exit 2.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence

from vla_rl.cli import data, failure, labels, services, taco, training
from vla_rl.cli.common import CliError, Command, hub_errors, parse, parse_config
from vla_rl.cli.common import user_errors as _user_errors
from vla_rl.core import lifeline
from vla_rl.core.logs import setup_logging
from vla_rl.core.scheduling import leave_realtime
from vla_rl.core.version import __version__
from vla_rl.hub.registry import DEFAULT_HUB

__all__ = ["COMMANDS", "CliError", "_user_errors", "main"]

log = logging.getLogger("vla_rl")

COMMANDS: list[Command] = [
    *training.COMMANDS[:2],
    *data.COMMANDS,
    *labels.COMMANDS,
    *taco.COMMANDS,
    *failure.COMMANDS,
    *training.COMMANDS[2:],
    *services.COMMANDS,
]
GROUPS = {
    "sim": "simulated robots",
    "store": "inspect, check, import and export episode stores",
    "label": "automatic labels (HELP segment critic)",
    "taco": "test-time chunk selection by pseudo-counts (TACO)",
    "failure": "the learned failure / takeover predictor (ask for help before failing)",
    "train": "train policies (one subcommand per algorithm)",
    "round": "post-training rounds: train on fleet data, evaluate, push, promote",
    "client": "talk to a policy server",
    "fleet": "simulated robot fleets",
    "hub": "checkpoint registry (Hub-compatible)",
}


def _global_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vla-rl",
        add_help=False,
        description="Improve robot VLA policies while they are deployed: simulated robots, an episode store "
        "for the fleet's data, flow-matching policies and post-training algorithms, a Hub-compatible "
        "checkpoint registry, a batched gRPC policy server, and rounds that publish better checkpoints.",
    )
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--version", action="version", version=f"vla-rl {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    p.add_argument("--hub", default=os.environ.get("VLA_RL_HUB", DEFAULT_HUB))
    p.add_argument("--hub-token", default=None)
    return p


def _usage(prefix: tuple[str, ...] = ()) -> str:
    lines = [
        "usage: vla-rl [--log-format text|json] [--log-level L] [--hub URL] COMMAND [SUBCOMMAND] [FLAGS]",
        "",
        _global_parser().description or "",
        "",
        "commands:" if not prefix else f"{' '.join(prefix)} commands:",
    ]
    for c in COMMANDS:
        if c.path[: len(prefix)] == prefix:
            lines.append(f"  vla-rl {' '.join(c.path):<24} {c.summary}")
    lines += [
        "",
        "global options (before COMMAND):",
        "  --log-format text|json   json: one object per log line",
        "  --log-level L            debug, info (default), warning, error",
        f"  --hub URL                Hub endpoint for hub:// refs (env VLA_RL_HUB; default {DEFAULT_HUB},",
        "                           the embedded registry; https://huggingface.co for the real Hub)",
        "  --hub-token T            Hub token (better: env VLA_RL_HUB_TOKEN or HF_TOKEN, not visible in ps)",
        "",
        "Every command has --help. Start with `vla-rl demo` (the whole loop at small scale, ~4 min).",
    ]
    return "\n".join(lines)


def _find(words: list[str]) -> tuple[Command | None, int]:
    """The command whose path is the longest prefix of ``words``, and how many words it used."""
    best: tuple[Command | None, int] = (None, 0)
    for c in COMMANDS:
        n = len(c.path)
        if tuple(words[:n]) == c.path and n > best[1]:
            best = (c, n)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (None: this program's command line); returns the exit code."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        if argv is None:
            # The program ends here: skip the cyclic GC of every object at interpreter shutdown. With torch
            # loaded it costs seconds on a busy machine, most of a Ctrl-C'd service's stop; the OS takes
            # the memory back (atexit handlers and the freeing of what is not in a cycle still run).
            gc.freeze()


def _main(argv: list[str]) -> int:
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    # global options take a value: step over "--hub URL"-style pairs to find the command word
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("--log-level", "--log-format", "--hub", "--hub-token") else 1
    first = i
    g = _global_parser().parse_args(argv[:first])
    rest = argv[first:]
    command, used = _find(rest)
    if command is None:
        prefix = tuple(w for w in rest[:1] if w in GROUPS)
        unknown = rest[: 1 if not prefix else 2]
        if rest and (not prefix or (len(rest) > 1 and not rest[1].startswith("-"))):
            print(
                f"error: no command {' '.join(unknown)!r}; see: vla-rl {' '.join(prefix)} --help",
                file=sys.stderr,
            )
            return 2
        print(_usage(prefix))
        return 0 if g.help or not rest or prefix else 2
    setup_logging(g.log_level, g.log_format)
    # First thing before any work: whatever this command starts inherits its scheduling (vla_rl.core.scheduling).
    leave_realtime("vla-rl " + " ".join(command.path))
    # Ctrl-C stops it even where it was started ignoring SIGINT; started by `vla-rl up`: it stops with up.
    lifeline.install("vla-rl " + " ".join(command.path))
    from vla_rl.hub.registry import configure_hub

    # Before anything imports huggingface_hub (lerobot, transformers): it reads these at import.
    configure_hub(g.hub, g.hub_token or os.environ.get("VLA_RL_HUB_TOKEN") or os.environ.get("HF_TOKEN"))
    prog = "vla-rl " + " ".join(command.path)
    args = rest[used:]
    try:
        with hub_errors():
            if command.args is None:
                return int(command.run(args, prog) or 0)
            cls = command.args if isinstance(command.args, type) else command.args()
            doc = cls.__doc__ or command.summary
            if command.config_file:  # a service: its config dataclass, --config FILE, one-line errors
                parsed = parse_config(cls, args, prog, doc)
            else:
                parsed = parse(cls, args, prog, doc)
            return int(command.run(parsed) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # tyro: --help (0) or a bad flag (2, its message already printed)
        return int(e.code or 0) if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
