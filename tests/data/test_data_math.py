"""MathDataModule on real GSM8K / MATH500 files: questions and extracted answers match the file,
ids are "<part>/<row>", evaluation rows are held out, the stream resumes exactly, and config
mistakes are named before anything is loaded.

The full files under ``../shared/data`` are used when they are beside the repository; a fresh
clone uses the 30-line samples under ``tests/data_samples`` (the first lines of the same files),
and rows past their end are left out of the checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl_lightning.data import MathDataModule, MathPart
from mrl_lightning.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FULL, SAMPLES = REPO.parent / "shared" / "data", REPO / "tests" / "data_samples"
DATA = FULL if all((FULL / n / "test.jsonl").is_file() for n in ("gsm8k", "math500")) else SAMPLES
GSM8K, MATH500 = DATA / "gsm8k" / "test.jsonl", DATA / "math500" / "test.jsonl"
IS_FULL = DATA == FULL
N_LINES = {"gsm8k": len(GSM8K.read_text(encoding="utf-8").splitlines()),
           "math500": len(MATH500.read_text(encoding="utf-8").splitlines())}
EVAL = {"gsm8k": 50, "math500": 40} if IS_FULL else {"gsm8k": 10, "math500": 8}
GSM8K_PATTERN = r"####\s*(.+?)\s*$"


def _in_file(prompt_id: str) -> bool:
    part, row = prompt_id.split("/")
    return int(row) < N_LINES[part]


def _parts(gsm_eval=EVAL["gsm8k"], math_eval=EVAL["math500"], gsm_weight=1.0, math_weight=1.0):
    return [
        MathPart("gsm8k", str(GSM8K), split="test", answer_pattern=GSM8K_PATTERN, eval_size=gsm_eval,
                 weight=gsm_weight),
        MathPart("math500", str(MATH500), split="test", question_field="problem", eval_size=math_eval,
                 weight=math_weight),
    ]


@pytest.fixture(scope="module")
def dm():
    module = MathDataModule(_parts(), batch_size=4, seed=0)
    module.setup()
    return module


def _all_items(module):
    items = [x for part in ("gsm8k", "math500") for x in module.train_items(part)]
    items += [x for xs in module.eval_items().values() for x in xs]
    return {x.prompt_id: x for x in items}


# Hand-checked against the files: row index (0-based line), question start, final answer.
KNOWN = [
    ("gsm8k/0", "Janet\u2019s ducks lay 16 eggs per day.", "18"),
    ("gsm8k/2", "Josh decides to try flipping a house.", "70000"),
    ("gsm8k/146", None, "2,125"),
    ("gsm8k/1318", "Henry and 3 of his friends order 7 pizzas", "14"),
    ("math500/0", "Convert the point $(0,3)$ in rectangular coordinates", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("math500/2", "If $f(x) = \\frac{3x-2}{x-2}$", "\\frac{14}{3}"),
    ("math500/3", "How many positive whole-number divisors does 196 have?", "9"),
    ("math500/4", None, "\\text{Evelyn}"),
]


@pytest.mark.parametrize("prompt_id, question_start, answer", [k for k in KNOWN if _in_file(k[0])],
                         ids=[k[0] for k in KNOWN if _in_file(k[0])])
def test_known_rows_give_their_question_and_extracted_answer(dm, prompt_id, question_start, answer):
    item = _all_items(dm)[prompt_id]
    part, row = prompt_id.split("/")
    assert item.part == part and item.entry["row"] == int(row)
    if question_start is not None:
        assert item.question.startswith(question_start)
    assert item.answer == answer
    assert "####" not in item.answer


def test_every_row_is_used_once_with_its_file_line(dm):
    items = _all_items(dm)
    lines = {"gsm8k": GSM8K.read_text(encoding="utf-8").splitlines(),
             "math500": MATH500.read_text(encoding="utf-8").splitlines()}
    assert len(items) == len(lines["gsm8k"]) + len(lines["math500"]) == (1319 + 500 if IS_FULL else 30 + 30)
    assert dm.dropped == {"gsm8k": 0, "math500": 0}
    for prompt_id in filter(_in_file, ("gsm8k/7", "gsm8k/29", "gsm8k/1000", "math500/17", "math500/77",
                                       "math500/499")):
        part, row = prompt_id.split("/")
        raw = json.loads(lines[part][int(row)])
        assert items[prompt_id].question == raw["question" if part == "gsm8k" else "problem"]


def test_eval_rows_are_held_out_and_fixed_by_the_seed(dm):
    evals = dm.eval_items()
    assert {k: len(v) for k, v in evals.items()} == EVAL
    for part, items in evals.items():
        train = dm.train_items(part)
        assert not {x.prompt_id for x in items} & {x.prompt_id for x in train}
        assert not {x.question for x in items} & {x.question for x in train}
    again = MathDataModule(_parts(), batch_size=4, seed=0).eval_items()
    other = MathDataModule(_parts(), batch_size=4, seed=1).eval_items()
    assert [x.prompt_id for x in again["gsm8k"]] == [x.prompt_id for x in evals["gsm8k"]]
    assert [x.prompt_id for x in other["gsm8k"]] != [x.prompt_id for x in evals["gsm8k"]]


def test_batches_are_split_by_weight():
    module = MathDataModule(_parts(gsm_weight=3.0), batch_size=4)
    for _ in range(3):
        batch = module.next_batch()
        # int(4 * 3/4) = 3 GSM8K prompts, int(4 * 1/4) = 1 MATH500 prompt
        assert [x.part for x in batch] == ["gsm8k"] * 3 + ["math500"]


def _small_file(tmp_path, rows=6, broken=()):
    """The first ``rows`` real GSM8K lines; rows in ``broken`` lose their '#### x' line."""
    lines = GSM8K.read_text(encoding="utf-8").splitlines()[:rows]
    out = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        if i in broken:
            row["answer"] = row["answer"].rsplit("####", 1)[0]
        out.append(json.dumps(row))
    path = tmp_path / "gsm8k_small.jsonl"
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def test_resume_continues_the_same_stream_across_epochs(tmp_path):
    path = _small_file(tmp_path)

    def make():
        return MathDataModule([MathPart("g", str(path), answer_pattern=GSM8K_PATTERN, eval_size=1)], batch_size=2)

    ref = make()
    stream = [[x.prompt_id for x in ref.next_batch()] for _ in range(7)]  # 5 training rows: wraps twice
    first = make()
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    assert state == {"position": {"g": {"epoch": 1, "cursor": 1}}}
    resumed = make()
    resumed.load_state_dict(state)
    assert [[x.prompt_id for x in resumed.next_batch()] for _ in range(4)] == stream[3:]
    with pytest.raises(ValueError, match="differ"):
        resumed.load_state_dict({"position": {"other": {"epoch": 0, "cursor": 0}}})


def test_rows_without_an_extractable_answer_are_dropped_with_a_warning(tmp_path):
    path = _small_file(tmp_path, broken=(1, 4))
    module = MathDataModule([MathPart("g", str(path), answer_pattern=GSM8K_PATTERN)], batch_size=1)
    with pytest.warns(UserWarning, match="dropped 2 of 6"):
        items = module.train_items("g")
    assert [x.prompt_id for x in items] == ["g/0", "g/2", "g/3", "g/5"]


def test_fingerprint_follows_config_and_file_bytes(tmp_path):
    path = _small_file(tmp_path)

    def fp(seed=0):
        return MathDataModule([MathPart("g", str(path), answer_pattern=GSM8K_PATTERN)], seed=seed).fingerprint()

    before = fp()
    assert fp() == before and fp(seed=1) != before
    path.write_text(path.read_text(encoding="utf-8").replace("ducks", "geese"), encoding="utf-8")
    assert fp() != before


def test_missing_file_names_part_path_and_fix_before_loading(tmp_path):
    missing = tmp_path / "nope" / "test.jsonl"
    with pytest.raises(ConfigError) as info:
        MathDataModule([MathPart("gsm8k", str(missing))])
    msg = str(info.value)
    assert "data.parts[gsm8k].path" in msg and str(missing) in msg
    assert "absolute path" in msg and "hub dataset id" in msg


def test_several_config_problems_are_reported_at_once(tmp_path):
    parts = [MathPart("a/b", str(GSM8K), answer_pattern="####", weight=0.0, eval_size=-1),
             MathPart("m", str(MATH500), answer_pattern="(unclosed"), MathPart("m", str(MATH500))]
    with pytest.raises(ConfigError) as info:
        MathDataModule(parts, batch_size=2)
    msg = str(info.value)
    for part in ("name='a/b'", "weight=0.0", "eval_size=-1", "no capture group", "not a valid regex",
                 "must be unique", "batch_size=2"):
        assert part in msg


def test_wrong_field_lists_the_columns(tmp_path):
    module = MathDataModule([MathPart("m", str(MATH500), split="test")])  # MATH500 has 'problem'
    with pytest.raises(ConfigError) as info:
        module.setup()
    assert "question_field='question'" in str(info.value) and "'problem'" in str(info.value)


def test_eval_size_must_leave_training_rows(tmp_path):
    module = MathDataModule([MathPart("g", str(_small_file(tmp_path)), answer_pattern=GSM8K_PATTERN,
                                      eval_size=6)])
    with pytest.raises(ConfigError, match="eval_size=6 leaves no training row"):
        module.setup()
