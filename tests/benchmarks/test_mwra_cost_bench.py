"""benchmarks/mwra_cost.py: the plan's prediction lines read back as numbers, and its refusals."""

from __future__ import annotations

import pytest

from benchmark_loader import load_benchmark

LOG = """Resource plan (MWRA):
placement cost: disjoint, the shortest predicted step (calibrated in 2.5 s, 1 thread(s) a worker; ...); to pin it: x
  * disjoint (gpt2: 1, llama: 1): 0.16 s a step [sampling + update (+ all-reduce): gpt2 0.09 + 0.07 s, llama 0.07 + 0.05 s (idle 25%)]
    colocated (gpt2: 2, llama: 2): 0.17 s a step [sampling + update (+ all-reduce): gpt2 0.05 + 0.04 + 0.01 s, llama 0.04 + 0.03 + 0.00 s]
    for comparison, one process on 2 threads (gpt2: 1, llama: 1): 0.23 s a step [sampling + update (+ all-reduce): gpt2 0.06 + 0.09 s, llama 0.06 + 0.03 s] (--trainer.devices 1)
"""


def test_the_prediction_lines_are_read_with_the_chosen_one_and_the_all_reduce_in_the_update():
    bench = load_benchmark("mwra_cost")
    got = bench.predictions(LOG)
    assert set(got) == {"disjoint", "colocated", "one_process"}
    assert [m for m, p in got.items() if p["chosen"]] == ["disjoint"]
    assert got["one_process"]["s_per_step"] == 0.23
    assert got["colocated"]["policies"]["gpt2"] == {"sampling_s": 0.05, "update_s": pytest.approx(0.05)}
    assert got["disjoint"]["policies"]["llama"] == {"sampling_s": 0.07, "update_s": 0.05}


def test_a_log_without_predictions_and_too_few_steps_are_refused(tmp_path, capsys):
    bench = load_benchmark("mwra_cost")
    with pytest.raises(SystemExit, match="no prediction"):
        bench.predictions("Resource plan (MWRA):\nplacement: disjoint\n")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--steps", "2"])
    assert "at least 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "none"), "--read-only"])
    assert "holds no cost run" in capsys.readouterr().err
