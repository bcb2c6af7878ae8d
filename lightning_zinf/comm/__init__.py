"""Communication: the collectives the engine uses and the bytes they move."""

from lightning_zinf.comm.collectives import Collectives, CommBytes, Handle
from lightning_zinf.comm.topology import NodeGroups, RankSetGroups, Topology

__all__ = ["Collectives", "CommBytes", "Handle", "NodeGroups", "RankSetGroups", "Topology"]
