"""The ``mrl`` subcommands that build runs: ``fit`` (LightningCLI over ``MRLTrainer``) and ``export``.

The entry point itself is :mod:`mrl_lightning.cli`; ``thl`` and ``bandit`` live with their
layers (:mod:`mrl_lightning.thl.cli`, :mod:`mrl_lightning.analysis.cli`).
"""
