"""Who holds whose copy: the job's nodes, and each rank's partners on other nodes.

A node is a home of the host tier: the ranks that share a host-memory area (its host
name and area name), as the sharded save's first exchange defines them. The nodes form a
ring in the order of their lowest rank; rank ``r``, the ``i``-th rank of its node, sends
its part to the ``i``-th rank (modulo their number) of the next ``k`` nodes of the ring.
When the nodes name failure domains (``SNAPCORE_FAILURE_DOMAIN``), the ring interleaves
the domains and a partner in another domain is taken before one in the same.

Pure functions of what every rank gathered, so every rank computes the same map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Home", "Topology"]


@dataclass(frozen=True)
class Home:
    """One rank's place: its host, its host-memory area, its failure domain."""

    host: str
    area: str | None
    domain: str | None = None

    @property
    def node(self) -> tuple[str, str | None]:
        return (self.host, self.area)

    def to_json(self) -> list[Any]:
        return [self.host, self.area, self.domain]

    @classmethod
    def from_json(cls, x: Any) -> Home:
        host, area, domain = x
        return cls(str(host), None if area is None else str(area), domain)


@dataclass
class Topology:
    """The ring of nodes and each rank's partners (``k`` per rank, capped at the number
    of other nodes)."""

    homes: list[Home]
    k: int = 1
    nodes: list[list[int]] = field(init=False)  # ranks of each node, ring order
    node_of: list[int] = field(init=False)  # rank -> index in ``nodes``
    _partners: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        by_node: dict[tuple[str, str | None], list[int]] = {}
        for r, h in enumerate(self.homes):
            by_node.setdefault(h.node, []).append(r)
        plain = sorted(by_node.values(), key=lambda ranks: ranks[0])
        # Interleave failure domains (round robin over them, each in rank order), so that
        # neighbours on the ring are in different domains when the domains allow it.
        domains: dict[str | None, list[list[int]]] = {}
        for ranks in plain:
            domains.setdefault(self.homes[ranks[0]].domain, []).append(ranks)
        queues = sorted(domains.values(), key=lambda q: q[0][0])
        self.nodes = []
        while any(queues):
            for q in queues:
                if q:
                    self.nodes.append(q.pop(0))
        self.node_of = [0] * len(self.homes)
        for n, ranks in enumerate(self.nodes):
            for r in ranks:
                self.node_of[r] = n
        self._partners = [self._choose(r) for r in range(len(self.homes))]

    @property
    def world_size(self) -> int:
        return len(self.homes)

    def _choose(self, rank: int) -> list[int]:
        n = self.node_of[rank]
        count = len(self.nodes)
        i = self.nodes[n].index(rank)
        mine = self.homes[rank].domain
        ring = [(n + d) % count for d in range(1, count)]
        # another failure domain first (when known), then ring distance
        ring.sort(key=lambda m: (mine is not None and self.homes[self.nodes[m][0]].domain == mine,))
        out = []
        for m in ring[: self.k]:
            ranks = self.nodes[m]
            out.append(ranks[i % len(ranks)])
        return out

    def partners(self, rank: int) -> list[int]:
        """The ranks (on other nodes) that hold copies of ``rank``'s part."""
        return list(self._partners[rank])

    def sources(self, rank: int) -> list[int]:
        """The ranks whose parts ``rank`` holds copies of."""
        return [q for q in range(self.world_size) if rank in self._partners[q]]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]
