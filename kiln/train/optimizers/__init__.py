"""Optimizers torch does not ship (LAMB, Lion, Muon) or cannot step on sharded parameters (Adafactor);
built by `kiln.train.optim.build_optimizer`."""

from kiln.train.optimizers.adafactor import Adafactor
from kiln.train.optimizers.lamb import Lamb
from kiln.train.optimizers.lion import Lion
from kiln.train.optimizers.muon import Muon
from kiln.train.optimizers.newton_schulz import orthogonalize

__all__ = ["Adafactor", "Lamb", "Lion", "Muon", "orthogonalize"]
