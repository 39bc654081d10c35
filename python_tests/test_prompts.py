"""Training prompt sources: never an evaluation prompt, fixed order, code stubs that parse."""
import ast

import pytest

from dflash_ext.prompts import (CODE_INSTRUCTION, SHAREGPT_EVAL_OFFSET, TRAINING_SOURCES, iter_sharegpt_first_turns,
                                iter_sharegpt_human_turns, load_prompts, sharegpt_later_turn_records,
                                training_prompts)


def test_stdlib_code_stubs_parse_and_keep_their_order():
    stubs = training_prompts("stdlib-code")
    assert len(stubs) > 1000
    assert stubs == training_prompts("stdlib-code")  # the first N are the same N every time
    assert len(set(stubs)) > 0.95 * len(stubs)
    for s in stubs[:300]:
        head, code = s.split("\n\n", 1)
        assert head + "\n\n" in (CODE_INSTRUCTION, CODE_INSTRUCTION.replace("function", "method"))
        tree = ast.parse(code)  # a signature with its docstring as the body
        fn = tree.body[0] if isinstance(tree.body[0], ast.FunctionDef) else tree.body[0].body[0]
        assert isinstance(fn, ast.FunctionDef) and len(ast.get_docstring(fn)) >= 40


def test_code_stubs_are_not_humaneval():
    humaneval = {p.split("\n\n", 1)[1] for p in load_prompts("humaneval", 200)}
    assert not humaneval & {s.split("\n\n", 1)[1] for s in training_prompts("stdlib-code")}


@pytest.mark.slow
def test_sharegpt_sources_stop_before_the_evaluation_records():
    first = load_prompts("sharegpt", 50)  # what bench/e2e.py evaluates on (offset SHAREGPT_EVAL_OFFSET)
    later = training_prompts("sharegpt-later-turns")
    train_first = training_prompts("sharegpt")
    assert len(train_first) == SHAREGPT_EVAL_OFFSET and len(later) > 5000
    assert all(len(t.strip()) >= 64 for t in later)
    assert not set(first) & (set(later) | set(train_first))
    records = sharegpt_later_turn_records()  # prompt i's ShareGPT record, in order
    convs = [t for _, t in zip(range(SHAREGPT_EVAL_OFFSET), iter_sharegpt_human_turns())]
    assert len(records) == len(later) and records == sorted(records)
    assert all(later[k] in convs[records[k]][1:] for k in range(len(later)))
    assert [t[0] for _, t in zip(range(20), iter_sharegpt_human_turns())] == \
        [p for _, p in zip(range(20), iter_sharegpt_first_turns())]


def test_sources_have_disjoint_record_ids():
    bases = sorted(base for _, base in TRAINING_SOURCES.values())
    assert bases[0] == 0 and all(b - a >= SHAREGPT_EVAL_OFFSET * 10 for a, b in zip(bases, bases[1:]))


def test_unknown_source_is_named():
    with pytest.raises(ValueError, match="unknown training prompt source 'nope'"):
        training_prompts("nope")
