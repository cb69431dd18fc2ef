"""Optimizers torch does not ship: LAMB, Lion and Muon (built by `kiln.train.optim.build_optimizer`)."""

from kiln.train.optimizers.lamb import Lamb
from kiln.train.optimizers.lion import Lion
from kiln.train.optimizers.muon import Muon, orthogonalize

__all__ = ["Lamb", "Lion", "Muon", "orthogonalize"]
