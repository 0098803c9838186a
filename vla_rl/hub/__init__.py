"""Checkpoint registry on a Hugging Face Hub, and a small Hub-compatible server for one machine.

``vla_rl.hub.registry`` pushes and pulls checkpoint folders with the real ``huggingface_hub`` client (this
package re-exports it); ``vla_rl.hub.server`` is the local server (imported on demand: it needs FastAPI).
Importing this package does not import ``huggingface_hub``, so :func:`configure_hub` can still take effect.
"""

from vla_rl.hub.registry import (
    Checkpoint,
    HubRef,
    HubSettings,
    configure_hub,
    is_hub_ref,
    move_ref,
    parse_ref,
    pull,
    push_folder,
    resolve,
)

__all__ = [
    "Checkpoint",
    "HubRef",
    "HubSettings",
    "configure_hub",
    "is_hub_ref",
    "move_ref",
    "parse_ref",
    "pull",
    "push_folder",
    "resolve",
]
