"""Contextual-bandit analysis of the probes (docs/bandit.md), run by ``mrl bandit``.

Modules: ``bandit`` (problem, policies, sampling, THL residual), ``updates`` (per-probe
update rules as pure functions), ``config`` (settings and probe arms), ``simulate``
(training and Monte-Carlo measurement), ``report`` (JSON, CSV, PNG, table), ``cli``.
"""
