"""MathDataModule with separate training and evaluation sources (train on X, evaluate on Y), split
slices, and answers read from the last ``\\boxed{}`` of a worked solution (MATH's training split),
on the GSM8K / MATH500 lines under ``../shared/data`` or the shipped samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl_lightning.data import MathDataModule, MathPart, MathSource
from mrl_lightning.data.sources import last_boxed
from mrl_lightning.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FULL, SAMPLES = REPO.parent / "shared" / "data", REPO / "tests" / "data_samples"
DATA = FULL if all((FULL / n / "test.jsonl").is_file() for n in ("gsm8k", "math500")) else SAMPLES
GSM8K, MATH500 = DATA / "gsm8k" / "test.jsonl", DATA / "math500" / "test.jsonl"
GSM8K_PATTERN = r"####\s*(.+?)\s*$"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("text, expected", [
    (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),                      # nested braces
    (r"first \boxed{3}, then \boxed{4}", "4"),                               # the last box
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                                       # escaped braces are content
    (r"\fbox{7}", "7"),
    (r"The answer is $\boxed 5$.", "5"),                                      # no brace: the token after it
    (r"\boxed{ \text{Evelyn} }", r"\text{Evelyn}"),                          # stripped
    (r"\boxed{3", None),                                                      # never closes
    (r"\boxed{}", None),                                                      # empty
    ("no box here: 12", None),
    (r"\boxedx{3}", None),                                                    # another command, not a box
])
def test_last_boxed_takes_the_last_box_with_matched_braces(text, expected):
    assert last_boxed(text) == expected


def test_last_box_of_every_math500_solution_is_its_answer_field():
    rows = _lines(MATH500)
    assert [last_boxed(r["solution"]) for r in rows] == [r["answer"] for r in rows]
    assert len(rows) in (30, 500)


def test_a_solution_column_read_with_last_boxed_gives_the_answer_column():
    # MATH's training split has only 'problem' and 'solution': read it the way MATH500's 'answer' is read
    solutions = MathDataModule([MathPart("math", str(MATH500), split="test", question_field="problem",
                                         answer_field="solution", answer_extract="last_boxed")], batch_size=1)
    answers = MathDataModule([MathPart("math", str(MATH500), split="test", question_field="problem")], batch_size=1)
    got = {x.prompt_id: x.answer for x in solutions.train_items("math")}
    assert got == {x.prompt_id: x.answer for x in answers.train_items("math")}
    assert got["math/0"] == r"\left( 3, \frac{\pi}{2} \right)" and got["math/3"] == "9"  # hand-checked rows


def _train_test(eval_size=0, train_split="test[:22]", eval_split="test[22:30]"):
    return MathDataModule([MathPart(
        "gsm8k", str(GSM8K), split=train_split, answer_pattern=GSM8K_PATTERN, eval_size=eval_size,
        eval_source=MathSource(str(GSM8K), split=eval_split, answer_pattern=GSM8K_PATTERN))], batch_size=2, seed=0)


def test_train_on_one_slice_and_evaluate_on_another():
    lines = _lines(GSM8K)
    module = _train_test()
    train, evals = module.train_items("gsm8k"), module.eval_items()["gsm8k"]
    # every training row stays in training; the evaluation rows are the other slice, all of it (eval_size 0)
    assert [x.prompt_id for x in train] == [f"gsm8k/{i}" for i in range(22)]
    assert [x.prompt_id for x in evals] == [f"gsm8k/eval/{i}" for i in range(8)]
    assert [x.question for x in evals] == [r["question"] for r in lines[22:30]]
    assert [x.question for x in train] == [r["question"] for r in lines[:22]]
    assert evals[0].part == "gsm8k" and evals[0].entry["source"].endswith(":test[22:30]")
    assert module.overlap_dropped == {"gsm8k": 0}
    # eval_size draws that many rows of the eval source, fixed by the seed
    three = [x.prompt_id for x in _train_test(eval_size=3).eval_items()["gsm8k"]]
    assert len(three) == 3 and set(three) < {x.prompt_id for x in evals}
    assert three == [x.prompt_id for x in _train_test(eval_size=3).eval_items()["gsm8k"]]


def test_training_rows_that_are_evaluation_questions_are_dropped_with_a_warning():
    module = _train_test(train_split="test[:24]")  # rows 22 and 23 are also the first two evaluation rows
    with pytest.warns(UserWarning, match=r"dropped 2 training rows whose question is also an evaluation question"):
        train = module.train_items("gsm8k")
    assert [x.prompt_id for x in train] == [f"gsm8k/{i}" for i in range(22)]
    assert module.overlap_dropped == {"gsm8k": 2}


def test_an_evaluation_question_of_another_part_is_never_trained_on(tmp_path):
    # a training file that holds one of MATH500's evaluation questions under another part's name
    math_rows = _lines(MATH500)[:4]
    leaked = {"question": math_rows[1]["problem"], "answer": "#### 1"}
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in [*_lines(GSM8K)[:3], leaked]) + "\n", encoding="utf-8")
    module = MathDataModule([
        MathPart("gsm8k", str(train), answer_pattern=GSM8K_PATTERN),
        MathPart("math", str(MATH500), split="test[4:8]", question_field="problem",
                 eval_source=MathSource(str(MATH500), split="test[:4]", question_field="problem")),
    ], batch_size=2)
    with pytest.warns(UserWarning, match="dropped 1 training rows") as record:
        module.setup()
    assert [x.prompt_id for x in module.train_items("gsm8k")] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert module.overlap_dropped == {"gsm8k": 1, "math": 0}
    assert "data.parts[gsm8k]" in str(record[0].message)


def test_eval_source_config_mistakes_are_named_at_once_before_loading(tmp_path):
    missing = tmp_path / "nope.jsonl"
    parts = [
        MathPart("g", str(GSM8K), split="test", answer_pattern=GSM8K_PATTERN,
                 eval_source=MathSource(str(GSM8K), split="test", answer_pattern=GSM8K_PATTERN)),
        MathPart("m", str(MATH500), split="test[:5", answer_extract="boxed",
                 eval_source={"path": str(missing), "answer_extract": "last_boxed", "answer_pattern": "(x)"}),
    ]
    with pytest.raises(ConfigError) as info:
        MathDataModule(parts, batch_size=2)
    msg = str(info.value)
    assert "data.parts[g].eval_source is the training source itself" in msg and "split: test" in msg
    assert "data.parts[m].split='test[:5'" in msg and "'train[10%:]'" in msg
    assert "data.parts[m].answer_extract='boxed'; valid: ['pattern', 'last_boxed']" in msg
    assert f"data.parts[m].eval_source.path={str(missing)!r} is not an existing file" in msg
    assert "data.parts[m].eval_source.answer_pattern='(x)' is unused with answer_extract: last_boxed" in msg


def test_eval_size_above_the_eval_source_rows_is_refused():
    module = _train_test(eval_size=9)  # the slice test[22:30] has 8 rows
    with pytest.raises(ConfigError, match=r"eval_size=9 but its eval_source has 8 usable rows"):
        module.setup()


def test_an_empty_slice_names_the_split():
    module = MathDataModule([MathPart("g", str(GSM8K), split="test[5:2]", answer_pattern=GSM8K_PATTERN)])
    with pytest.raises(ConfigError, match=r"data.parts\[g\].split='test\[5:2\]' gives no rows"):
        module.setup()


def test_box_extraction_that_finds_nothing_names_the_fix():
    module = MathDataModule([MathPart("g", str(GSM8K), split="test", answer_extract="last_boxed")])
    with pytest.raises(ConfigError, match=r"answer_extract='last_boxed' found no \\boxed\{\.\.\.\} in 'answer'"):
        module.setup()


def test_fingerprint_of_a_plain_part_is_unchanged_and_follows_the_eval_source(tmp_path):
    import hashlib

    plain = MathPart("g", str(GSM8K), split="test", answer_pattern=GSM8K_PATTERN, eval_size=4)
    # the hash written out as it was computed before eval_source existed (warm-start caches stay valid)
    h = hashlib.sha256(b"0")
    h.update(repr(("g", str(GSM8K), "test", None, "question", "answer", GSM8K_PATTERN, 4, 1.0)).encode())
    h.update(hashlib.sha256(GSM8K.read_bytes()).digest())
    assert MathDataModule([plain]).fingerprint() == h.hexdigest()[:12]
    with_eval = _train_test().fingerprint()
    assert with_eval != _train_test(eval_split="test[23:30]").fingerprint()
