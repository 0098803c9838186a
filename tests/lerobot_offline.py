"""What every test of LeRobot VLAs shares: no connection may leave this machine (:func:`offline`), and
the actions LeRobot's own ``from_pretrained`` of a saved folder takes (:func:`lerobot_actions`), to compare
with ours."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Refuse and record every connection that leaves this machine (a library that swallows the error
    still fails the test), with the Hugging Face Hub offline. Use it in a fixture, never at import:
    collection imports every test module in every process, and the rest of the suite talks to a local
    registry."""
    real, attempts = socket.socket.connect, []

    def connect(self: socket.socket, address: Any) -> Any:
        host = address[0] if isinstance(address, tuple) else None
        if host is not None:
            try:
                local = ipaddress.ip_address(host).is_loopback
            except ValueError:
                local = host == "localhost"
            if not local:
                attempts.append(address)
                raise OSError(f"a test tried to reach {address}")
        return real(self, address)

    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield
    assert not attempts, f"tried to reach {attempts}"


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def from_pretrained(folder: Path) -> Any:
    """``folder`` loaded by LeRobot's own ``PreTrainedPolicy.from_pretrained`` (its class from the type)."""
    from lerobot.policies.factory import get_policy_class

    from policies.lerobot_adapter import read_lerobot_config
    from policies.lerobot_local import pi_sizes, read_pi_sizes

    config = read_lerobot_config(folder)
    assert config is not None, f"{folder} is not a LeRobot policy folder"
    sizes = read_pi_sizes(folder)
    with pi_sizes(sizes) if sizes is not None else contextlib.nullcontext():
        return get_policy_class(config["type"]).from_pretrained(str(folder))


@torch.no_grad()
def lerobot_actions(
    theirs: Any, folder: Path, obs: dict[str, Any], noise: torch.Tensor, camera_keys: Any
) -> torch.Tensor:
    """Env-unit chunks ``[B, H, A]`` of LeRobot's policy ``theirs`` (:func:`from_pretrained` of ``folder``,
    with the folder's own pre/post-processors) for our observation batch ``obs`` on initial ``noise``
    ``[B, H, D]``: what LeRobot's own server would act."""
    from lerobot.policies.factory import make_pre_post_processors

    from policies.lerobot_adapter import to_lerobot_batch

    pre, post = make_pre_post_processors(theirs.config, pretrained_path=str(folder))
    raw = to_lerobot_batch(len(noise), obs["state"], obs["cameras"], obs["instruction"], camera_keys)
    return post(theirs.predict_action_chunk(pre(raw), noise=noise.clone()))
