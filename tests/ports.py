"""Loopback ports for the tests' servers and process groups."""

import socket


def free_port() -> int:
    """A loopback port nothing listens on at the time of the call (the OS picks it; the probe is closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
