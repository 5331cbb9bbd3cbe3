"""Lightning-style callbacks wrapping SEE, THL and the probes (selected by class_path).

Probes compose: a run may list several (e.g. ``SharedExperienceExchange`` then
``CrossPolicyAdvantage`` then ``SuccessGatedTransfer``). For each policy,
``on_compose_batch`` is called on every callback in *list order* on one
:class:`~mrl_lightning.update.batch.TrainBatch` that starts with plain GRPO advantages:

- ``CrossPolicyAdvantage`` (XGRPO) and ``PeerRolloutPooling`` (PRP; both in docs/probes.md)
  *replace* ``batch.advantages`` of the own samples, each computed from rewards (neither
  reads the incoming advantages). With both on, the one later in the list decides the
  own-sample advantages; PRP's peer loss term stays whatever the order. A note saying
  which one wins is printed at setup.
- ``SuccessGatedTransfer`` (SGT, docs/probes.md) and PRP *append* a loss term to
  ``batch.aux_losses``; appended terms add up and never replace each other.
- ``SharedExperienceExchange`` must come before every probe: it provides the
  ``"exchange"`` service the probes declare in ``requires`` (read as ``ctx.exchange``;
  checked before any model is built, :func:`~mrl_lightning.callbacks.base.service_errors`).

So XGRPO + SGT (``transfer_mode: nll``) gives XGRPO's advantages on own samples plus SGT's
transfer term, in either order; PRP + SGT gives PRP's pooled advantages, its peer term and
SGT's term. SGT's ``transfer_mode: group`` rewrites the rescued prompts' advantages too, so
beside XGRPO or PRP for the same receivers it is refused at set-up.
"""

from mrl_lightning.callbacks.base import MRLCallback
from mrl_lightning.callbacks.exchange import SharedExperienceExchange
from mrl_lightning.callbacks.none import NoSharing
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer

__all__ = ["MRLCallback", "NoSharing", "SharedExperienceExchange", "SuccessGatedTransfer"]

from mrl_lightning.callbacks.prp import PeerRolloutPooling  # noqa: E402
from mrl_lightning.callbacks.xgrpo import CrossPolicyAdvantage  # noqa: E402

__all__ += ["CrossPolicyAdvantage", "PeerRolloutPooling"]
