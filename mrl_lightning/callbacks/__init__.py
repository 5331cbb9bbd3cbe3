"""Lightning-style callbacks wrapping SEE, THL and the probes (selected by class_path)."""

from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.callbacks.exchange import SharedExperienceExchange
from mrl_lightning.callbacks.none import NoSharing
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer

__all__ = ["MRLCallback", "NoSharing", "SharedExperienceExchange", "SuccessGatedTransfer"]
