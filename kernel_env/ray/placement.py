"""Where a new episode goes: pure functions over the hosts' loads (no Ray here).

The caller's own node first, when it hosts kernels and has a free slot: its steps then travel
over that node's loopback, never the network, and its kernels share nothing with another
trainer's. Otherwise the host with the largest share of free slots (least loaded), ties broken
at random so that many clients placing at once do not all pick the same host.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HostLoad", "choose"]


@dataclass(frozen=True)
class HostLoad:
    """What placement needs to know of one host: its node and its slots."""

    node_id: str
    sessions: int  # open sessions, one kernel each
    slots: int  # sessions it may hold (the node's declared kernel_env resource)

    @property
    def free(self) -> int:
        return max(0, self.slots - self.sessions)


def choose(
    loads: Iterable[HostLoad], *, own_node: str | None = None, rng: random.Random | None = None
) -> HostLoad | None:
    """The host for a new episode, or None when no host has a free slot."""
    free = [load for load in loads if load.free > 0]
    if not free:
        return None
    for load in free:
        if load.node_id == own_node:
            return load
    best = max(load.free / load.slots for load in free)
    tied = [load for load in free if load.free / load.slots == best]
    return (rng or random).choice(tied)
