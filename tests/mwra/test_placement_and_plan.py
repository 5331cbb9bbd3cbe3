"""MWRA placement and resource plan: pure checks, no process launched, no model built."""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import build_placement, shard_indices
from mrl_lightning.mwra.plan import ModelShape, PolicyPlacement, policy_memory_bytes, validate_resources

NAMES = ["gpt2", "llama"]


def test_colocated_puts_every_policy_on_every_rank():
    p = build_placement("colocated", None, NAMES, 2)
    assert p.groups == {"gpt2": (0, 1), "llama": (0, 1)}
    assert p.policies_on(1) == NAMES


def test_disjoint_gives_contiguous_rank_blocks_in_policy_order():
    p = build_placement("disjoint", {"gpt2": 4, "llama": 4}, NAMES, 8)
    assert p.groups == {"gpt2": (0, 1, 2, 3), "llama": (4, 5, 6, 7)}
    assert p.policies_on(5) == ["llama"] and p.leader("llama") == 4


def test_auto_is_colocated_on_one_rank_and_disjoint_when_ranks_split_evenly():
    assert build_placement("auto", None, NAMES, 1).mode == "colocated"
    assert build_placement("auto", None, NAMES, 2).groups == {"gpt2": (0,), "llama": (1,)}
    assert build_placement("auto", None, NAMES, 3).mode == "colocated"


@pytest.mark.parametrize("ranks, world, words", [
    ({"gpt2": 2, "llama": 1}, 2, ["asks for 3 ranks", "trainer.devices"]),
    ({"gpt2": 1, "llama": 0}, 1, ["trainer.policy_ranks.llama=0", "at least 1 rank"]),
    ({"gpt2": 1}, 1, ["trainer.policy_ranks.llama=None"]),
    ({"gpt2": 1, "lama": 1}, 2, ["'lama'", "did you mean 'llama'", "model.policies"]),
    ({"gpt2": 1, "llama": 1}, 3, ["would idle"]),
])
def test_bad_disjoint_plans_name_the_field_and_the_fix(ranks, world, words):
    with pytest.raises(ConfigError) as info:
        build_placement("disjoint", ranks, NAMES, world)
    for word in words:
        assert word in str(info.value)


def test_disjoint_on_one_rank_for_two_policies_is_refused_with_a_fix_that_works():
    with pytest.raises(ConfigError, match="set --trainer.devices 2 \\(one per policy\\) or --trainer.placement colocated"):
        build_placement("disjoint", None, NAMES, 1)
    build_placement("disjoint", None, NAMES, 2)  # the fix named


def test_an_uneven_split_suggests_policy_ranks_that_sum_to_the_world():
    with pytest.raises(ConfigError) as info:
        build_placement("disjoint", None, NAMES, 3)
    suggested = eval(str(info.value).split("(e.g. ")[1].split(")")[0])  # a dict literal
    assert sum(suggested.values()) == 3
    build_placement("disjoint", suggested, NAMES, 3)


def test_unknown_placement_and_policy_ranks_with_colocated_are_refused():
    with pytest.raises(ConfigError, match="did you mean 'disjoint'"):
        build_placement("disjiont", None, NAMES, 2)
    with pytest.raises(ConfigError, match="only applies to trainer.placement: disjoint"):
        build_placement("colocated", {"gpt2": 1, "llama": 1}, NAMES, 2)


@pytest.mark.parametrize("n, size", [(16, 2), (16, 3), (5, 4), (7, 7), (3, 1)])
def test_shards_are_strided_whole_prompts_whose_union_is_the_batch(n, size):
    shards = [shard_indices(n, i, size) for i in range(size)]
    assert sorted(sum(shards, [])) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards[0][:2] == ([0, size] if n > size else [0])


def test_every_shard_of_a_part_ordered_batch_holds_every_part():
    batch = ["add"] * 8 + ["sub"] * 8  # the data module lays a batch out part by part
    for rank in range(2):
        assert {batch[i] for i in shard_indices(16, rank, 2)} == {"add", "sub"}


def _rows(ranks=((0,), (1,))):
    return [PolicyPlacement(name, "gpt2", 1000, 300, r, "cpu", "s", "32-true", 1, 0.1)
            for name, r in zip(NAMES, ranks)]


def _validate(**overrides):
    kwargs = dict(device="cpu", devices_per_node=2, available_devices=None, cores=2, threads=1, threads_given=True,
                  batch_size=16, framework_gib=0.5, device_memory_gib=24.0)
    kwargs.update(overrides)
    validate_resources(_rows(), build_placement("disjoint", None, NAMES, 2), **kwargs)


def test_a_plan_that_fits_passes():
    _validate()


def test_threads_times_workers_above_the_cores_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as info:
        _validate(threads=2)
    assert "trainer.num_threads=2 x 2 worker(s)" in str(info.value) and "--trainer.num_threads 1" in str(info.value)
    _validate(threads=2, threads_given=False)  # derived, not asked: no error (the loop derives 1 here)


def test_more_devices_than_the_node_has_is_refused():
    with pytest.raises(ConfigError, match="this node has 1 cuda device"):
        _validate(device="cuda", available_devices=1, device_memory_gib=80.0)


def test_memory_over_a_known_device_size_is_refused():
    with pytest.raises(ConfigError, match="needs an estimated"):
        _validate(device_memory_gib=0.5)


def test_memory_over_the_device_names_the_policy_and_the_settings_that_drive_the_estimate():
    """"needs 403.9 GiB" named neither the policy nor the fields that made it so."""
    from types import SimpleNamespace

    from mrl_lightning.mwra.plan import build_plan

    shape = ModelShape("llama", params=135_000_000, vocab=49_152, hidden=576, layers=30, heads=9)
    policies = {name: SimpleNamespace(num_generations=4, micro_batch_size=None, max_prompt_length=64, beta=0.0,
                                      max_completion_length=length, use_peft=False, gradient_checkpointing=False)
                for name, length in (("gpt2", 32), ("llama", 200_000))}
    placement = build_placement("disjoint", None, NAMES, 2)
    rows = build_plan(placement, dict.fromkeys(NAMES, shape), policies, 4, "cpu", "s", "32-true", 1)
    with pytest.raises(ConfigError) as info:
        validate_resources(rows, placement, device="cpu", devices_per_node=2, available_devices=None, cores=2,
                           threads=1, threads_given=True, batch_size=4, framework_gib=0.5, device_memory_gib=64.0)
    line = next(x for x in str(info.value).splitlines() if "needs an estimated" in x)
    assert "but this node's 64.0 GiB of RAM; policy 'llama' takes " in line
    assert ("driven by max_completion_length=200000, max_prompt_length=64, num_generations=4, data.batch_size=4, "
            "micro_batch_size=null: lower max_completion_length, num_generations or data.batch_size, or set "
            "micro_batch_size, for model.policies 'llama', or use more devices") in line


def test_memory_over_the_device_at_evaluation_names_the_evaluation_settings():
    """``data.eval_size 100000``: the peak was evaluation's, but the line named the training settings, whose fixes
    did not help."""
    from types import SimpleNamespace

    from mrl_lightning.mwra.plan import build_plan

    shape = ModelShape("llama", params=135_000_000, vocab=49_152, hidden=576, layers=30, heads=9)
    policies = {name: SimpleNamespace(num_generations=4, micro_batch_size=None, max_prompt_length=64, beta=0.0,
                                      max_completion_length=32, use_peft=False, gradient_checkpointing=False)
                for name in NAMES}
    placement = build_placement("disjoint", None, NAMES, 2)
    rows = build_plan(placement, dict.fromkeys(NAMES, shape), policies, 4, "cpu", "s", "32-true", 1,
                      eval_prompts=100_000, eval_generations=8)
    assert {r.peak for r in rows} == {"evaluation"}
    with pytest.raises(ConfigError) as info:
        validate_resources(rows, placement, device="cpu", devices_per_node=2, available_devices=None, cores=2,
                           threads=1, threads_given=True, batch_size=4, framework_gib=0.5, device_memory_gib=64.0)
    line = next(x for x in str(info.value).splitlines() if "needs an estimated" in x)
    assert ("at its peak (evaluation: one part's held-out prompts, data.eval_size, times trainer.eval_num_generations, "
            "sampled at once, with max_completion_length): lower data.eval_size or trainer.eval_num_generations "
            "(0 = greedy only), or use more devices") in line


def test_a_group_larger_than_the_batch_is_refused():
    with pytest.raises(ConfigError, match="data.batch_size=1"):
        validate_resources(_rows(((0, 1), (0, 1))), build_placement("colocated", None, NAMES, 2), device="cpu",
                           devices_per_node=2, available_devices=None, cores=2, threads=1, threads_given=True,
                           batch_size=1, framework_gib=0.5, device_memory_gib=24.0)


def test_memory_estimate_counts_optimizer_state_and_the_reference_model():
    shape = ModelShape("gpt2", params=1_000_000, vocab=100, hidden=8, layers=1, heads=1)

    class P:
        num_generations, micro_batch_size, max_prompt_length, max_completion_length, beta = 1, None, 1, 1, 0.0

    without = policy_memory_bytes(shape, P(), 1)
    P.beta = 0.1
    with_ref = policy_memory_bytes(shape, P(), 1)
    # 16 bytes per parameter + a probe term's second gradient (4 a parameter, one row's layer, the head's gradient)
    assert without == 16_000_000 + 4_000_000 + 2 * 1088 + 4 * 100 * 8 + 5 * 4 * 200  # and one row's logits
    assert with_ref - without == 4_000_000


def test_a_worker_holds_every_policys_states_but_one_policys_activations_at_a_time():
    from mrl_lightning.mwra.plan import worker_memory_gib

    rows = [PolicyPlacement("a", "gpt2", 1, 1, (0,), "cpu", "s", "32-true", 1, memory_gib=3.0, states_gib=1.0),
            PolicyPlacement("b", "llama", 1, 1, (0, 1), "cpu", "s", "32-true", 1, memory_gib=2.5, states_gib=2.0)]
    # rank 0 runs both: 0.5 framework + (states 1 + 2 + the larger activations, 2 vs 0.5) and 10% allocator slack
    assert worker_memory_gib(rows, 0, 0.5) == pytest.approx(0.5 + 1.1 * (3.0 + 2.0))
    assert worker_memory_gib(rows, 1, 0.5) == pytest.approx(0.5 + 1.1 * 2.5)


@pytest.mark.parametrize("value, expected", [("1", 1), ("3", 3), ("", None), ("0", None), ("two", None)])
def test_threads_per_worker_follow_omp_num_threads_when_not_configured(monkeypatch, value, expected):
    """``trainer.num_threads: null`` takes ``OMP_NUM_THREADS`` when it is a positive integer."""
    from mrl_lightning.mwra.plan import omp_threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert omp_threads() == expected


def test_the_plan_marks_a_recipes_sizes_as_upper_bounds_and_a_folders_as_exact():
    from mrl_lightning.mwra.plan import format_plan

    placement = build_placement("colocated", None, ["tiny", "folder"], 1)
    common = dict(ranks=(0,), device="cpu", strategy="SingleDeviceStrategy", precision="32-true", threads=2,
                  memory_gib=0.1)
    rows = [PolicyPlacement(policy="tiny", family="gpt2", params=470_000, vocab=320, size_is_bound=True, **common),
            PolicyPlacement(policy="folder", family="llama", params=1_200_000, vocab=300, **common)]
    text = format_plan(rows, placement, framework_gib=0.3)
    tiny = next(line for line in text.splitlines() if line.startswith("tiny"))
    folder = next(line for line in text.splitlines() if line.startswith("folder"))
    assert "<=320" in tiny and "<=0.47M" in tiny
    assert "<=" not in folder and " 300 " in folder
    assert "upper bound" in text.splitlines()[-1]
    assert "upper bound" not in format_plan(rows[1:], placement, framework_gib=0.3)


def test_a_cpu_worker_under_bf16_counts_the_kernel_cache_once_and_float32_does_not(monkeypatch):
    from mrl_lightning.mwra import plan
    from mrl_lightning.mwra.memory import CPU_BF16_KERNEL_CACHE_GIB

    placement = build_placement("colocated", None, ["a"], 1)
    shape = ModelShape("llama", params=1_000, vocab=100, hidden=8, layers=1, heads=1)

    class P:
        num_generations, micro_batch_size, max_prompt_length, max_completion_length, beta = 2, None, 4, 4, 0.0

    monkeypatch.setattr(plan, "process_rss_bytes", lambda: 0.5 * plan.GIB)

    def total(precision):
        text, _ = plan.plan_resources(placement, {"a": shape}, {"a": P()}, 1, "cpu", "SingleDeviceStrategy",
                                      precision, 1, 1)
        return float(text.splitlines()[-1].split("rank 0: ")[1]), text

    fp32, text32 = total("32-true")
    bf16, text16 = total("bf16-mixed")
    assert bf16 - fp32 == pytest.approx(CPU_BF16_KERNEL_CACHE_GIB, abs=0.006)  # once on the worker
    assert "kernel cache" in text16 and "kernel cache" not in text32


def test_a_recipe_policy_says_its_sizes_are_bounds_and_a_folder_policy_does_not(tmp_path):
    from types import SimpleNamespace

    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    assert PolicyModule(name="a", model=TinyCausalLM(family="gpt2")).builds_from_recipe
    # a folder source (building a real PolicyModule on one needs a saved model and tokenizer)
    assert not PolicyModule.builds_from_recipe.fget(SimpleNamespace(model_source=str(tmp_path)))


def test_omp_num_threads_times_workers_above_the_cores_is_refused_naming_the_variable(monkeypatch):
    """``OMP_NUM_THREADS=8`` with two workers on two cores is 16 threads: refused as ``trainer.num_threads 8``
    is, naming the variable (it was taken silently into the plan before)."""
    from mrl_lightning.mwra import plan

    placement = build_placement("disjoint", None, ["a", "b"], 2)
    shape = ModelShape("llama", params=1_000, vocab=100, hidden=8, layers=1, heads=1)

    class P:
        num_generations, micro_batch_size, max_prompt_length, max_completion_length, beta = 2, None, 4, 4, 0.0

    monkeypatch.setattr(plan, "process_rss_bytes", lambda: 0.5 * plan.GIB)
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)

    def run(num_threads):
        return plan.plan_resources(placement, {"a": shape, "b": shape}, {"a": P(), "b": P()}, 2, "cpu",
                                   "DDPStrategy", "32-true", 2, num_threads)

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    with pytest.raises(ConfigError) as info:
        run(None)
    assert "OMP_NUM_THREADS=8 x 2 worker(s) per node = 16 threads on 2 CPU core(s)" in str(info.value)
    assert "OMP_NUM_THREADS=1" in str(info.value)
    assert run(1)[1] == 1  # trainer.num_threads given wins over the variable
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(None)[1] == 1
