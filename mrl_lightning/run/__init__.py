"""A run's lifecycle on disk and at its end: checkpoints, the run folder, how a run stops.

``checkpoint`` (atomic, weights-only checkpoint files and their checks), ``state`` (what a
run's checkpoint holds, how the ranks write and restore it, the run folder), ``stop`` (one
message per error, the exit status); docs/loop.md "Checkpoints", docs/reliability.md.
"""
