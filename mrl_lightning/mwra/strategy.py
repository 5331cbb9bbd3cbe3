"""The Fabric strategy of multi-worker runs: DDP's launcher and process group, no DDP wrapper.

:class:`PolicyGroupsStrategy` is Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`
(same launchers: one process per device, ``torchrun``, SLURM and the other cluster
environments Fabric detects; same ``gloo`` / ``nccl`` process group, with a timeout)
except that ``fabric.setup`` does not wrap a model in ``DistributedDataParallel``.

Why not DDP's wrapper: DDP all-reduces gradients over the *whole* world from autograd
hooks and needs every rank to run the same backward passes. Here a policy's gradients
must be reduced inside its own group of ranks only, and probes add loss terms whose
count differs from rank to rank (SGT has transfers for some prompts, not others). So
each policy's gradients are all-reduced once per optimizer step, over its group, with
``torch.distributed.all_reduce`` (:meth:`mrl_lightning.mwra.workers.Workers.reduce_gradients`):
the collective DDP itself uses, called at a point every rank of the group reaches.

The launcher of a one-node run is :class:`~mrl_lightning.mwra.launcher.WorkerLauncher`:
Lightning's subprocess launcher whose workers die with it and whose watch lets a failed
worker's own message and exit status stand (docs/reliability.md, "Stopping").
"""

from __future__ import annotations

from datetime import timedelta

from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module

from mrl_lightning.mwra.launcher import WorkerLauncher


class PolicyGroupsStrategy(DDPStrategy):
    """DDP launch and process group; models stay unwrapped (gradients reduced per policy group).

    Args:
        timeout_s: Timeout of the run's collectives in seconds (the groups
            :class:`~mrl_lightning.mwra.workers.Workers` creates); the rendezvous of the
            default group, while workers are still starting, gets at least 10 minutes.
    """

    def __init__(self, timeout_s: float = 1800.0, **kwargs) -> None:
        super().__init__(timeout=timedelta(seconds=max(timeout_s, 600.0)), start_method="popen", **kwargs)
        self.timeout_s = timeout_s

    def _configure_launcher(self) -> None:
        """Workers tied to the launcher, watched without Lightning's kill-everything observer."""
        assert self.cluster_environment is not None
        self._launcher = WorkerLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_module(self, module: Module) -> Module:
        """Place ``module`` on this rank's device without a DDP wrapper."""
        self.module_to_device(module)
        return module
