"""Communication: counted collectives (collectives.py) and autograd-aware ones (autograd.py)."""

from paratrain.comm.collectives import Axis, CommCounter, single_axis

__all__ = ["Axis", "CommCounter", "single_axis"]
