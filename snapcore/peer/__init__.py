"""The peer tier (docs/peer.md): each rank's host-memory snapshot copied into the host
memory of a partner rank on another node, so that a replaced node restores from its
partners' memory instead of object storage.

``topology`` (who partners whom), ``area`` (the peer namespace of a host area, and the
check and commit of a received copy), ``wire`` (one round of copies over snapcore's
peer group: torch.distributed point-to-point on gloo), ``link`` (the save path: the
peer thread, after each host commit), ``restore`` (the fetch of a replaced node's parts
before the restore's agreement, and the re-send).
"""

from __future__ import annotations

from .link import PeerLink, connect, open_link, peer_copies
from .restore import Fetched, prepare_restore

__all__ = ["Fetched", "PeerLink", "connect", "open_link", "peer_copies", "prepare_restore"]
