"""vla-rl: improve robot VLA policies while they are deployed.

Core package: shared specs and types, config, the CLI (and, as the project grows, wire contracts,
checkpoints and the Hub registry, the trainer and its algorithms, post-training rounds).
"""

__version__ = "0.1.0"
