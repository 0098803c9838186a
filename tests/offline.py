"""Tests that must not reach the internet (tiny LeRobot VLAs built here, Hugging Face libraries that
would happily download): :func:`no_internet` refuses every connection off this machine and records it,
so a library that swallows the error still fails the test.

Use it in a fixture, never at import: collection imports every test module in every process, so an
environment variable set at import would leak to the whole suite (which talks to a local registry).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def no_internet() -> Iterator[None]:
    """Inside: connections to loopback only, and the Hugging Face hub offline (``HF_HUB_OFFLINE``).
    Fails on exit if anything tried to leave the machine."""
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
