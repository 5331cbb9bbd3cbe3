"""Run ``mrl`` and press Ctrl-C when rank 0 enters a phase (for the multi-process stopping tests).

    python tests/e2e/e2e_interrupt.py PHASE STEP DELAY_S -- fit --config ...

Rank 0 (the launching process) sends SIGINT to its whole process group, as a terminal's
Ctrl-C does, ``DELAY_S`` seconds after it enters ``PHASE`` (0: at once, inside the phase) (a :meth:`Workers.phase
<mrl_lightning.mwra.Workers.phase>` name: build, rollout, update, checkpoint, eval, ...) at
a step >= ``STEP``. The workers it launches run this script too, unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager


def main(argv: list[str]) -> int:
    phase_name, at_step, delay = argv[0], int(argv[1]), float(argv[2])
    args = argv[argv.index("--") + 1:]
    from mrl_lightning.lifeline import is_launched_worker

    if not is_launched_worker():
        from mrl_lightning.mwra import workers

        phase = workers.Workers.phase
        sent = []

        @contextmanager
        def pressing(self, name, step=None):
            with phase(self, name, step):
                if name == phase_name and self.step >= at_step and not sent:
                    sent.append(name)
                    if delay > 0:
                        threading.Timer(delay, os.killpg, (os.getpgrp(), signal.SIGINT)).start()
                    else:  # at once: the KeyboardInterrupt is raised here, inside the phase
                        os.killpg(os.getpgrp(), signal.SIGINT)
                yield

        workers.Workers.phase = pressing
    from mrl_lightning.cli import main as mrl

    return mrl(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
