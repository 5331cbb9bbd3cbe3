"""A test-only callback that records what the probes are handed each step (imported by the configs by class path)."""

from __future__ import annotations

from mrl_lightning.callbacks.base import MRLCallback


class ComposeRecorder(MRLCallback):
    """Per step and policy: the groups ``on_compose_batch`` sees, its all-fail groups, and the groups kept for GRPO.

    Its state (checkpointed) maps ``"<step>/<policy>"`` to ``[seen, all_fail, kept]``, merged
    over ranks by summing, so a test can read what every probe was shown.
    """

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        success = batch.scored.success
        kept = int(batch.keep.sum()) if batch.keep is not None else success.shape[0]
        row = [success.shape[0], int((~success.any(dim=1)).sum()), kept]
        self.seen[f"{ctx.rollout_step}/{policy.policy_name}"] = row

    def state_dict(self) -> dict:
        return {"seen": {k: list(v) for k, v in self.seen.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seen = {k: list(v) for k, v in state_dict["seen"].items()}

    def merge_rank_states(self, states: list[dict]) -> dict:
        merged: dict[str, list[int]] = {}
        for state in states:
            for key, row in state["seen"].items():
                merged[key] = [a + b for a, b in zip(merged.get(key, [0, 0, 0]), row)]
        return {"seen": merged}

