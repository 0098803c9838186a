"""The version of the vla-rl distribution (reported by every service's health and info replies)."""

__version__ = "0.1.0"
