"""Held-out evaluation by question: question_key, distinct eval rows, no trained twin, refusals.

configs/real_small.yaml's ``mul`` part (1-digit products: reasoning-gym's 1-digit operands
are 0-10, so 121 ordered and 66 unordered questions) is the case that found the fault:
60 eval rows were 48 distinct questions, and 34 had their commuted twin in training.
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl_lightning.data.question_keys import question_key
from mrl_lightning.data.reasoning_gym import ReasoningGymDataModule, TaskPart
from mrl_lightning.errors import ConfigError

MUL = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["*"], allow_parentheses=False,
           allow_negation=False)
CHAIN = dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)


def _arith(expression: str) -> dict:
    """A basic_arithmetic entry's metadata: a dataset whose expression is the whole question."""
    return {"expression": expression, "source_dataset": "basic_arithmetic"}


def _key(item) -> str:
    return question_key(item.question, item.entry.get("metadata"))


def _mul(eval_size=20, train_size=300, part_eval_size=None):
    own = {} if part_eval_size is None else {"eval_size": part_eval_size}
    parts = [TaskPart("mul", "basic_arithmetic", MUL, **own),
             TaskPart("chain", "chain_sum", CHAIN)]
    return ReasoningGymDataModule(parts, batch_size=2, train_size=train_size, eval_size=eval_size, seed=0)


# ---------------------------------------------------------------- question_key
@pytest.mark.parametrize("a, b", [
    ("4 * 9", "9 * 4"),
    ("3 + 4", "4 + 3"),
    ("2 * 3 * 5", "5 * 2 * 3"),
    ("4 - 1 - 7", "4 - 7 - 1"),  # reordered subtrahends: the same signed terms
    ("4 + 3 - 2", "3 + 4 - 2"),
])
def test_commuted_questions_share_a_key(a, b):
    assert question_key(f"Calculate {a}.", _arith(a)) == question_key(f"Calculate {b}.", _arith(b))


@pytest.mark.parametrize("a, b", [
    ("5 - 3", "3 - 5"),
    ("4 * 9", "4 + 9"),
    ("2 + 3 * 4", "3 * 4 + 2"),  # mixed: the exact expression only
    ("8 / 2", "2 / 8"),
])
def test_other_questions_have_other_keys(a, b):
    assert question_key(a, _arith(a)) != question_key(b, _arith(b))


def test_without_an_expression_the_key_is_the_question_text():
    assert question_key(" Calculate  4 * 9.", {}) == question_key("Calculate 4 * 9.", None) == "text:Calculate 4 * 9."
    assert question_key("Calculate 4 * 9.") != question_key("Calculate 9 * 4.")


@pytest.mark.parametrize("dataset, config", [
    ("circuit_logic", dict(min_terms=1, max_terms=2, min_inputs=1, max_inputs=2)),  # expression: the circuit alone
    ("countdown", dict(min_numbers=3, max_numbers=3)),  # expression: one solution of the question
])
def test_where_the_expression_is_not_the_question_the_key_is_the_text(dataset, config):
    """Two texts are two keys (an expression shared by different questions merged them), one text one key."""
    import reasoning_gym

    entries = reasoning_gym.create_dataset(dataset, seed=0, size=600, **config)
    key_of = {}
    for e in entries:
        key = question_key(e["question"], e["metadata"])
        assert key_of.setdefault(e["question"], key) == key == "text:" + e["question"]
    expressions = {e["metadata"]["expression"] for e in entries}
    assert len(key_of) == len(set(key_of.values())) > len(expressions) or dataset == "countdown"


_TERMS = st.lists(st.integers(-12, 12), min_size=1, max_size=4)


def _expression(terms: list[int], operators: list[str]) -> str:
    out = str(terms[0])
    for op, t in zip(operators, terms[1:]):
        out += f" {op} {t}"
    return out


@settings(max_examples=200, deadline=None)
@given(terms=_TERMS, op=st.sampled_from(["+", "*"]), data=st.data())
def test_property_commuted_operands_share_a_key(terms, op, data):
    shuffled = data.draw(st.permutations(terms))
    a, b = _expression(terms, [op] * len(terms)), _expression(shuffled, [op] * len(terms))
    assert question_key("q1", _arith(a)) == question_key("q2", _arith(b))


_EXPRESSIONS = st.integers(1, 3).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-3, 3), min_size=n, max_size=n),
    st.lists(st.sampled_from(["+", "-", "*"]), min_size=n - 1, max_size=n - 1)))


@settings(max_examples=300, deadline=None)
@given(first=_EXPRESSIONS, second=_EXPRESSIONS)
def test_property_different_results_never_share_a_key(first, second):
    a, b = _expression(*first), _expression(*second)
    if question_key(a, _arith(a)) == question_key(b, _arith(b)):
        assert eval(a) == eval(b), (a, b)  # noqa: S307 - integers and + - * only


# ---------------------------------------------------------------- the data module
def test_eval_rows_are_distinct_questions():
    dm = _mul(eval_size=20)
    for part in ("mul", "chain"):
        evals = dm.eval_items()[part]
        assert len(evals) == 20 and len({_key(x) for x in evals}) == 20  # no repeat, commuted or not
        assert len({x.question for x in evals}) == 20
        assert all(x.prompt_id.startswith(f"{part}/e") for x in evals)
    assert dm.eval_question_counts() == {"mul": 20, "chain": 20}


def test_no_commuted_twin_of_an_eval_question_is_trained():
    dm = _mul(eval_size=20)
    for part in ("mul", "chain"):
        assert not {_key(x) for x in dm.eval_items()[part]} & {_key(x) for x in dm.train_items(part)}
    held = {x.entry["metadata"]["expression"] for x in dm.eval_items()["mul"]}
    trained = {x.entry["metadata"]["expression"] for x in dm.train_items("mul")}
    assert not {" * ".join(reversed(e.split(" * "))) for e in held} & trained  # "4 * 9" held out, "9 * 4" trained


def test_a_part_of_its_own_eval_size():
    dm = _mul(eval_size=30, part_eval_size=12)
    assert dm.eval_question_counts() == {"mul": 12, "chain": 30}
    assert dm.fingerprint() != _mul(eval_size=30).fingerprint()


def test_the_count_is_logged_once_at_setup(caplog):
    dm = _mul(eval_size=10)
    with caplog.at_level(logging.INFO):
        dm.setup()
        dm.setup()
    said = [r.getMessage() for r in caplog.records if "held-out evaluation questions" in r.getMessage()]
    assert said == ["data: held-out evaluation questions (distinct, none trained on) per part: mul 10, chain 10"]


def test_a_question_space_too_small_for_eval_size_is_refused():
    with pytest.raises(ConfigError) as info:
        _mul(eval_size=70).setup()  # 66 unordered 1-digit products
    message = str(info.value)
    assert "\n" not in message
    for fragment in ("data.eval_size=70", "'mul'", "only 66 distinct questions", "lower data.eval_size to about 22",
                     "widen data.parts[mul].config"):
        assert fragment in message, fragment


def test_holding_out_most_of_the_training_rows_is_refused():
    with pytest.raises(ConfigError) as info:
        _mul(eval_size=45).setup()
    message = str(info.value)
    assert "\n" not in message
    for fragment in ("data.parts[mul]", "(45 its own)", "more than 50%", "lower data.eval_size=45"):
        assert fragment in message, fragment


def test_a_bad_part_eval_size_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data.parts\[mul\].eval_size=0 must be >= 1"):
        _mul(part_eval_size=0)


# ---------------------------------------------------------------- GSM8K / MATH: exact text
def _jsonl(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return str(path)


def test_a_math_source_that_repeats_a_question_evaluates_it_once(tmp_path):
    from mrl_lightning.data import MathDataModule, MathPart, MathSource

    questions = [f"Q{i % 4}" for i in range(12)]  # 4 distinct questions, each 3 times
    held_out = MathDataModule([MathPart("m", _jsonl(tmp_path / "a.jsonl", questions), answer_pattern=r"####\s*(.+)",
                                        eval_size=3)], batch_size=1)
    with pytest.warns(UserWarning, match="dropped 6 training rows"):  # the repeats of the 3 held-out questions
        evals = held_out.eval_items()["m"]
    assert len(evals) == len({x.question for x in evals}) == 3
    assert held_out.eval_question_counts() == {"m": 3}
    assert {x.question for x in held_out.train_items("m")} == set(questions) - {x.question for x in evals}
    every = MathDataModule([MathPart("m", _jsonl(tmp_path / "b.jsonl", ["T0", "T1"]), answer_pattern=r"####\s*(.+)",
                                     eval_source=MathSource(_jsonl(tmp_path / "c.jsonl", questions),
                                                            answer_pattern=r"####\s*(.+)"))], batch_size=1)
    assert [x.prompt_id for x in every.eval_items()["m"]] == ["m/eval/0", "m/eval/1", "m/eval/2", "m/eval/3"]
    with pytest.raises(ConfigError, match=r"eval_size=5 but its evaluation rows hold only 4 distinct questions"):
        MathDataModule([MathPart("m", _jsonl(tmp_path / "d.jsonl", questions), answer_pattern=r"####\s*(.+)",
                                 eval_size=5)], batch_size=1).setup()


def test_a_math_question_written_with_other_spacing_is_one_question(tmp_path):
    """Held out and dropped by question_key (whitespace normalized), as eval_question_counts counts them."""
    from mrl_lightning.data import MathDataModule, MathPart, MathSource

    train = [f"What is {i} + {i}?" for i in range(20)] + ["What is 3  +  3?"]
    evals = ["What is 3 + 3?", "What is 3 + 3? ", "What is 100 + 1?"]
    module = MathDataModule([MathPart("m", _jsonl(tmp_path / "t.jsonl", train), answer_pattern=r"####\s*(.+)",
                                      eval_source=MathSource(_jsonl(tmp_path / "e.jsonl", evals),
                                                             answer_pattern=r"####\s*(.+)"))], batch_size=1)
    with pytest.warns(UserWarning, match="dropped 2 training rows"):  # "What is 3 + 3?" in both spacings
        held = module.eval_items()["m"]
    assert [x.question for x in held] == ["What is 3 + 3?", "What is 100 + 1?"]
    assert module.eval_question_counts() == {"m": 2}
    assert not {" ".join(x.question.split()) for x in module.train_items("m")} & {"What is 3 + 3?"}


@pytest.mark.parametrize("a, b", [("3+5", "5 + 3"), ("3 +5", "5+3"), ("4*9", "9 * 4"), ("-2*3", "3 * -2"),
                                  ("3 - -5", "5 + 3")])
def test_the_key_does_not_depend_on_spacing(a, b):
    # reasoning-gym's whitespace option ("no_space", "random") writes one question several ways
    assert question_key("q", _arith(a)) == question_key("q", _arith(b))


def test_a_question_held_out_by_one_part_is_not_trained_by_another():
    # two parts over one question space: 1-digit sums, and 2-term chain sums of 1-digit terms
    add = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"], allow_parentheses=False,
               allow_negation=False)
    chain2 = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    dm = ReasoningGymDataModule([TaskPart("add", "basic_arithmetic", add), TaskPart("chain2", "chain_sum", chain2)],
                                batch_size=2, train_size=300, eval_size=10, seed=0)
    held = {_key(x) for evals in dm.eval_items().values() for x in evals}
    for part in ("add", "chain2"):
        assert not held & {_key(x) for x in dm.train_items(part)}
