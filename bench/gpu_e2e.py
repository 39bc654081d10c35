"""DFlash end to end at Qwen3-8B's shapes, random weights: the parts of a step, the target
alone, transformers' own DFlash loop, and the speedup as a function of τ.

    python -m bench.gpu_e2e --device cuda --out OUT   # Qwen3-8B config, bf16, contexts 1k and 8k
    python -m bench.gpu_e2e --small --out OUT         # narrow, same depth, on the CPU (the smoke test)

The target is a Qwen3ForCausalLM of the real Qwen3-8B config (hidden 4096, 36 layers, 32
heads, 8 K/V heads, head_dim 128, intermediate 12288, vocab 151936, rope theta 1e6),
random bf16 weights initialised on the device (never on the host); the drafter is shaped
as the published Qwen3-8B DFlash drafter (5 layers, B = 16, target layers 1, 9, 17, 25, 33).
Random weights accept almost no draft, so nothing here measures τ: each step is timed as
spec_generate runs it (speculative_step, CUDA synchronised between phases) and the speedup
at the paper's τ is

    speedup(τ) = τ · t_target / t_step

against two baselines: the target alone one token per pass on transformers' dynamic cache
(eager), and on its static cache with the one-token pass compiled (torch.compile
"reduce-overhead": CUDA graphs; the fastest a transformers user gets). A step at τ
injects τ rows and rolls back B - τ instead of ~B - 1 (measured here): both are small next
to a pass, so t_step at τ ≈ 1 stands for t_step at τ. Rows, most important first, each at
every context (1k, then 8k), what compiles nothing first: the target alone (eager), our step
(eager, dynamic cache), transformers' DFlash loop per step
(`generate(assistant_model=DFlashAssistant(drafter, target))`); then the target alone on the
static cache (compiled) and our step on it (the B-token verify compiled); last a
forced-acceptance check (an oracle drafting the target's greedy continuation: the first
tokens must be the target's); then the batch sweep (bench.batch.sweep: --batch-prompts
prompts of random lengths up to the first context, decoded by DFlash, target_generate and
transformers' generate in batches of 1, 2, 4, 8, 16, every row checked against its
single-prompt output; at τ ≈ 1 here, so per batch also speedup(τ) = τ · the target alone's
ms per batched pass / DFlash's). Results go to OUT/gpu_e2e.json (rewritten after each row: a
run cut short keeps what it measured) and OUT/gpu_e2e.txt. Off CUDA nothing compiles (the
same passes run eagerly).

The tree row (issue 66; ``--rows tree``, its own step of tools/gpu/gpu_e2e.sh): per context the
median ms of one chain step (B) and of one tree step (tree_step: the draft pass's B - 1
slots, the best tree of N nodes, one target pass of N + 1 tokens under the ancestor mask) for
N = 4, 8, 16, 32, 64: whether a wider pass costs about one pass on the device; the trees' τ
is the CPU bench's (bench.tree) or DDTree's.
"""
import argparse
import os
import statistics
import sys
import time

import torch

from bench import _common

# The paper's τ for Qwen3-8B (H200, transformers backend): average over its benchmarks
# (greedy), its best benchmark (MATH-500), the average at T = 1 (/work/shared/DESIGN.md §1).
PAPER_TAUS = {"avg greedy": 6.49, "MATH-500": 7.87, "avg T=1": 5.48}
ROWS = ["alone", "ours", "hf", "alone_static", "ours_static", "oracle", "batch", "tree"]
TREE_BUDGETS = (4, 8, 16, 32, 64)  # the tree row's node budgets (issue 66)
QWEN3_8B_DRAFTER = dict(num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33])


def target_config(small: bool):
    """Qwen3-8B's config, by hand (or, for --small, a narrow Qwen3 of its depth: the drafter's
    shape and target layers stay those of the GPU run)."""
    from transformers import Qwen3Config

    if small:
        return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=36,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           rms_norm_eps=1e-6, tie_word_embeddings=False)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters=dict(rope_type="default", rope_theta=1e6))


def build(args, device, dtype):
    """(target, drafter): random weights, created on `device` (a torch.device context)."""
    from transformers import AutoModelForCausalLM

    from dflash_ext import DFlashDrafter

    config = target_config(args.small)
    shape = dict(QWEN3_8B_DRAFTER, block_size=args.block)
    torch.manual_seed(args.seed)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        drafter = DFlashDrafter.from_target(config, seed=args.seed, **shape).to(dtype).eval()
    return target, drafter


class Timer:
    """Seconds between calls, CUDA synchronised first (the step's phases, one pass)."""

    def __init__(self, device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.sync()
        self.t = time.perf_counter()

    def lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        lap, self.t = now - self.t, now
        return lap


def ms(samples):
    return 1e3 * statistics.median(samples)


@torch.no_grad()
def time_target_alone(target, prompt, static: bool, args, cache_len: int) -> dict:
    """Median ms of one target pass over one token (plus its argmax, as target_generate
    takes it), after `args.warmup` untimed passes (the compile and the CUDA-graph capture)."""
    from dflash_ext.decode.runner import TargetRunner, make_static_cache

    runner = TargetRunner(target, compiled_sizes=(1,) if static else ())
    cache = make_static_cache(target, cache_len) if static else None
    logits, _, cache = runner(prompt, cache, hidden_states=False, last_logits_only=True)
    token = logits[0, -1:].argmax(-1)[None]
    timer, laps = Timer(prompt.device), []
    for _ in range(args.warmup + args.steps):
        timer.lap()
        logits, _, cache = runner(token, cache, hidden_states=False)
        token = torch.tensor([[int(logits[0, -1].argmax())]], device=prompt.device)
        laps.append(timer.lap())
    return dict(ms=ms(laps[args.warmup:]), compiled=runner.compiles)


class TimedRollback:
    """A CacheRollback whose calls are timed on their own (CUDA synchronised)."""

    def __init__(self, rollback, device):
        self.rollback, self.device, self.laps = rollback, device, []

    def check_pass(self, n):
        self.rollback.check_pass(n)

    def __call__(self, drop):
        timer = Timer(self.device)
        self.rollback(drop)
        self.laps.append(timer.lap())


@torch.no_grad()
def time_our_step(target, drafter, prompt, static: bool, args, cache_len: int) -> dict:
    """Median ms per phase of speculative_step (as spec_generate runs it, B = args.block):
    draft (propose + inject), verify (the target's pass over B tokens), rollback, rest
    (sampling, the accept rule); `args.warmup` untimed steps first."""
    from dflash_ext import DFlashProposer
    from dflash_ext.decode.rollback import CacheRollback
    from dflash_ext.decode.runner import TargetRunner, make_static_cache
    from dflash_ext.decode.step import DecodeState, OneRow, speculative_step
    from dflash_ext.sampling import Sampling

    B, n, device = args.block, prompt.shape[1], prompt.device
    runner = TargetRunner(target, drafter.config.target_layer_ids, compiled_sizes=(B,) if static else ())
    cache = make_static_cache(target, cache_len) if static else None
    logits, hidden, cache = runner(prompt, cache, last_logits_only=True)
    rollback = TimedRollback(CacheRollback(cache, B), device)
    state = DecodeState(OneRow(cache, rollback), [0], [int(logits[0, -1].argmax())], [n])
    proposer = DFlashProposer(drafter, target, capacity=cache_len)
    proposer.accept(hidden, slice(0, n), torch.arange(n, device=device))
    sampling = Sampling()  # greedy
    laps, emitted = {"draft": [], "verify": [], "other": []}, []
    for i in range(args.warmup + args.steps):
        totals, timer = dict.fromkeys(laps, 0.0), Timer(device)

        def clock(phase):
            totals[phase] += timer.lap()

        emitted.append(len(speculative_step(runner, proposer, state, B, sampling, clock)[0]))
        if i >= args.warmup:
            for phase, seconds in totals.items():
                laps[phase].append(seconds)
    rollbacks = rollback.laps[args.warmup:]
    rest = [o - r for o, r in zip(laps["other"], rollbacks)]
    step = [d + v + o for d, v, o in zip(laps["draft"], laps["verify"], laps["other"])]
    return dict(step_ms=ms(step), draft_ms=ms(laps["draft"]), verify_ms=ms(laps["verify"]),
                rollback_ms=ms(rollbacks), rest_ms=ms(rest), compiled=runner.compiles,
                measured_tau=statistics.mean(emitted[args.warmup:]))


@torch.no_grad()
def time_tree_steps(target, drafter, prompt, args, cache_len: int, budgets=TREE_BUDGETS) -> dict:
    """Median ms of one step per node budget N: the chain's (speculative_step, B = args.block)
    and the tree's (tree_step: the draft pass's B - 1 slots, the tree of N nodes, one target
    pass of N + 1 tokens under the ancestor mask, the path kept) over the same prompt, each
    after `args.warmup` untimed steps: what a tree costs per verify on this device (random
    weights: its tau is the CPU bench's, bench.tree, or DDTree's)."""
    from dflash_ext import DFlashProposer
    from dflash_ext.decode.rollback import CacheRollback
    from dflash_ext.decode.runner import TargetRunner
    from dflash_ext.decode.step import DecodeState, OneRow, speculative_step
    from dflash_ext.decode.tree import tree_step
    from dflash_ext.sampling import Sampling

    B, n, device = args.block, prompt.shape[1], prompt.device
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    proposer = DFlashProposer(drafter, target, capacity=cache_len + 2 * max(budgets))
    sampling = Sampling()  # greedy

    def median_step(budget: int) -> float:
        logits, hidden, cache = runner(prompt, None, last_logits_only=True)
        width = budget + 1 if budget else B
        state = DecodeState(OneRow(cache, CacheRollback(cache, width)), [0], [int(logits[0, -1].argmax())], [n])
        proposer.reset(proposer.capacity)
        proposer.accept(hidden, slice(0, n), torch.arange(n, device=device))
        laps = []
        for _ in range(args.warmup + args.steps):
            timer = Timer(device)
            if budget:
                tree_step(runner, proposer, state, B - 1, budget, sampling)
            else:
                speculative_step(runner, proposer, state, B, sampling)
            laps.append(timer.lap())
        return ms(laps[args.warmup:])

    chain = median_step(0)
    rows = [dict(budget=N, pass_tokens=N + 1, step_ms=median_step(N)) for N in budgets]
    for row in rows:
        row["over_chain"] = row["step_ms"] / chain
    return dict(chain_ms=chain, chain_pass_tokens=B, trees=rows)


@torch.no_grad()
def time_hf_step(target, drafter, prompt, args) -> dict:
    """Median ms per step of transformers' own DFlash loop (generate with the drafter as its
    assistant, greedy, dynamic cache): two generations of different lengths, the difference
    of their times over the difference of their steps (the prefill cancels)."""
    from dflash_ext import DFlashAssistant

    assistant = DFlashAssistant(drafter, target)

    def run(new_tokens):
        calls, timer = assistant.calls, Timer(prompt.device)
        target.generate(prompt, assistant_model=assistant, speculation_type="dflash", max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return timer.lap(), assistant.calls - calls

    run(args.block + 1)  # warm-up
    short, long_ = args.block + 1, args.block + 1 + args.steps * 2
    per_step = []
    for _ in range(3):
        (t0, c0), (t1, c1) = run(short), run(long_)
        per_step.append((t1 - t0) / max(1, c1 - c0))
    return dict(step_ms=ms(per_step), steps_per_generation=c1)


@torch.no_grad()
def oracle_check(target, drafter, device, args) -> dict:
    """Forced acceptance: an oracle drafts the target's greedy continuation; the first tokens
    of spec_generate (dynamic cache, and static cache with the compiled verify) must be the
    target's own greedy ones, with whole blocks accepted."""
    from dflash_ext import spec_generate, target_generate
    from dflash_ext.testing.oracle import OracleProposer

    g = torch.Generator().manual_seed(args.seed)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 64), generator=g).to(device)
    k = 2 * args.block + 1
    base = target_generate(target, prompt, k).tokens
    out = {}
    for static in (False, True):
        res = spec_generate(target, OracleProposer(base, prompt.shape[1], vocab), prompt, k, block_size=args.block,
                            static_cache=static)
        same = next((i for i, (a, b) in enumerate(zip(res.tokens, base)) if a != b), len(base))
        out["static" if static else "dynamic"] = dict(equal_prefix=same, tokens=k, tau=res.tau)
    out["ok"] = all(v["equal_prefix"] == k for v in out.values())
    return out


def speedups(row_alone, row_static_alone, ours, ours_static, hf) -> list:
    """speedup(τ) = τ · t_target / t_step at the paper's τ, against both target-alone baselines."""
    rows = []
    for name, tau in PAPER_TAUS.items():
        r = dict(tau_name=name, tau=tau)
        for label, step in (("ours", ours), ("ours_static", ours_static), ("hf", hf)):
            if step is None:
                continue
            for base_label, base in (("eager", row_alone), ("static", row_static_alone)):
                if base is not None:
                    r[f"{label}_vs_{base_label}"] = tau * base["ms"] / step["step_ms"]
        rows.append(r)
    return rows


def parse_args(argv=None):
    doc = __doc__
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda (default) or cpu; --small: cpu")
    ap.add_argument("--small", action="store_true", help="a narrow Qwen3 target of Qwen3-8B's depth, the same drafter shape (the CPU smoke test)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt tokens (default 1024 8192; small 24)")
    ap.add_argument("--block", type=int, default=None, help="B (default 16; small 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps / passes per row (default 20; small 3)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps / passes first: the compile and the CUDA-graph capture (default 3)")
    ap.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS,
                    help="what to run, in this order, each at every context (default all, most important first: "
                         "what compiles nothing, then the compiled rows, then the oracle check)")
    ap.add_argument("--cache-len", choices=["shared", "context"], default="shared",
                    help="static cache rows: 'shared' (default) one length for every context (the longest + the "
                         "steps: one compile per pass size; shorter contexts attend over masked rows too, about "
                         "7%% more bytes per pass at 1k of 8k), or 'context' sized per context (fairer, compiles "
                         "again per context)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes of the batch row "
                    "(default 1 2 4 8 16; small 1 2)")
    ap.add_argument("--batch-prompts", type=int, default=None, help="prompts of the batch row (default 16; small 3)")
    ap.add_argument("--batch-new-tokens", type=int, default=None, help="new tokens per prompt (default 32; small 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(_common.OUT_DIR, "gpu_e2e"), help="folder for gpu_e2e.json / .txt")
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.small else "cuda")
    args.contexts = args.contexts or ([24] if args.small else [1024, 8192])
    args.block = args.block or (4 if args.small else 16)
    args.steps = args.steps or (3 if args.small else 20)
    args.batches = args.batches or ([1, 2] if args.small else [1, 2, 4, 8, 16])
    args.batch_prompts = args.batch_prompts or (3 if args.small else 16)
    args.batch_new_tokens = args.batch_new_tokens or (5 if args.small else 32)
    return args


def batch_sweep(target, drafter, args, log) -> dict:
    """bench.batch's sweep over random prompts (8 tokens to the first context), with
    speedup(τ) per batch at the paper's τ from the measured ms per batched pass."""
    from bench.batch import report as batch_report
    from bench.batch import sweep

    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(8, max(9, args.contexts[0]), (args.batch_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    result = sweep(target, drafter, prompts, args.batches, args.batch_new_tokens, args.block, log=log)
    for row in result["rows"]:
        row["speedup_at_tau"] = {name: tau * row["alone"]["ms_per_step"] / row["dflash"]["ms_per_step"]
                                 for name, tau in PAPER_TAUS.items()}
    result["table"] = batch_report(result)
    return result


def report(results) -> str:
    lines = [results["header"], results["note"]]
    cols = [("context", "context", "{}"), ("alone_ms", "alone eager ms", "{:.2f}"),
            ("alone_static_ms", "alone static ms", "{:.2f}"), ("step_ms", "step ms", "{:.2f}"),
            ("draft_ms", "draft", "{:.2f}"), ("verify_ms", "verify", "{:.2f}"), ("rollback_ms", "rollback", "{:.3f}"),
            ("rest_ms", "rest", "{:.2f}"), ("static_step_ms", "static step ms", "{:.2f}"),
            ("static_verify_ms", "static verify", "{:.2f}"), ("hf_step_ms", "hf step ms", "{:.2f}"),
            ("ours_over_hf", "ours/hf", "{:.2f}"), ("static_over_hf", "static/hf", "{:.2f}")]
    flat = []
    for c in results["contexts"]:
        o, s, h = c.get("ours") or {}, c.get("ours_static") or {}, c.get("hf") or {}
        flat.append(dict(context=c["context"], alone_ms=(c.get("alone") or {}).get("ms"),
                         alone_static_ms=(c.get("alone_static") or {}).get("ms"), step_ms=o.get("step_ms"),
                         draft_ms=o.get("draft_ms"), verify_ms=o.get("verify_ms"), rollback_ms=o.get("rollback_ms"),
                         rest_ms=o.get("rest_ms"), static_step_ms=s.get("step_ms"), static_verify_ms=s.get("verify_ms"),
                         hf_step_ms=h.get("step_ms"),
                         ours_over_hf=o["step_ms"] / h["step_ms"] if h and o else None,
                         static_over_hf=s["step_ms"] / h["step_ms"] if h and s else None))
    lines.append(_common.format_table(flat, cols, "# per pass / per step (median ms; our step time over transformers')"))
    for c in results["contexts"]:
        keys = [k for k in ("ours_vs_eager", "ours_vs_static", "ours_static_vs_eager", "ours_static_vs_static",
                            "hf_vs_eager", "hf_vs_static") if any(k in r for r in c["speedup"])]
        lines.append(_common.format_table(c["speedup"], [("tau_name", "τ of", "{}"), ("tau", "τ", "{:.2f}")] +
                                          [(k, k, "{:.2f}x") for k in keys],
                                          f"# speedup(τ) = τ · t_target / t_step at context {c['context']}"))
    trees = [dict(context=c["context"], **r) for c in results["contexts"] if c.get("tree")
             for r in [dict(budget=0, pass_tokens=c["tree"]["chain_pass_tokens"], step_ms=c["tree"]["chain_ms"],
                            over_chain=1.0)] + c["tree"]["trees"]]
    if trees:
        lines.append(_common.format_table(trees, [("context", "context", "{}"), ("budget", "tree nodes (0: chain)", "{}"),
                                                  ("pass_tokens", "pass tokens", "{}"), ("step_ms", "step ms", "{:.2f}"),
                                                  ("over_chain", "x chain step", "{:.2f}")],
                                          "# tree steps: median ms per step by node budget (tau: bench.tree)"))
    if "oracle" in results:
        lines.append(f"# forced acceptance (oracle drafter): {results['oracle']}")
    if "batch" in results:
        lines.append(results["batch"]["table"])
        lines.append(_common.format_table(
            [dict(batch=r["batch"], alone=r["alone"]["ms_per_step"], dflash=r["dflash"]["ms_per_step"],
                  **r["speedup_at_tau"]) for r in results["batch"]["rows"]],
            [("batch", "batch", "{}"), ("alone", "alone ms/pass", "{:.2f}"), ("dflash", "DFlash ms/step", "{:.2f}")]
            + [(name, f"speedup at τ {tau}", "{:.2f}x") for name, tau in PAPER_TAUS.items()],
            "# batched: speedup(τ) = τ · t_alone pass / t_DFlash step, per batch size"))
    return "\n\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_e2e: --device cuda requested but torch.cuda.is_available() is False (--small runs on the CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    log = _common.logger()
    dtype = torch.float32 if args.small and device.type == "cpu" else torch.bfloat16
    target, drafter = build(args, device, dtype)
    log(f"built the target and the drafter on {device} ({dtype})")
    # The compiled graphs are shaped by the static length: one length for every context, one
    # compile per pass size (a static cache sized for the longest context, as a server would).
    room = (args.warmup + args.steps + 2) * (args.block + 1)
    cache_len = max(args.contexts) + room
    meta = _common.metadata(device, dtype=str(dtype).replace("torch.", ""), block=args.block, steps=args.steps,
                            warmup=args.warmup, small=args.small,
                            static_cache_len=cache_len if args.cache_len == "shared" else f"context + {room}",
                            config=target.config.to_dict() if args.small else "Qwen3-8B (by hand)",
                            drafter=dict(num_layers=len(drafter.layers), block_size=drafter.config.block_size,
                                         target_layer_ids=list(drafter.config.target_layer_ids)))
    results = dict(metadata=meta, header=_common.header(meta), contexts=[], note=(
        "random weights: τ is not measured; speedup(τ) = τ · t_target / t_step with t_step measured at τ ≈ 1"))
    os.makedirs(args.out, exist_ok=True)
    json_path, txt_path = os.path.join(args.out, "gpu_e2e.json"), os.path.join(args.out, "gpu_e2e.txt")

    def save():
        for c in results["contexts"]:
            c["speedup"] = speedups(c.get("alone"), c.get("alone_static"), c.get("ours"), c.get("ours_static"),
                                    c.get("hf"))
        _common.write_json(json_path, results)
        with open(txt_path, "w") as f:
            f.write(report(results) + "\n")

    g = torch.Generator().manual_seed(args.seed)
    rows = lambda p: cache_len if args.cache_len == "shared" else p.shape[1] + room
    runs = {"alone": lambda p: time_target_alone(target, p, False, args, rows(p)),
            "ours": lambda p: time_our_step(target, drafter, p, False, args, rows(p)),
            "hf": lambda p: time_hf_step(target, drafter, p, args),
            "alone_static": lambda p: time_target_alone(target, p, True, args, rows(p)),
            "ours_static": lambda p: time_our_step(target, drafter, p, True, args, rows(p)),
            "tree": lambda p: time_tree_steps(target, drafter, p, args, rows(p))}
    prompts = [torch.randint(0, target.config.vocab_size, (1, c), generator=g).to(device) for c in args.contexts]
    results["contexts"] = [dict(context=c) for c in args.contexts]
    for key in (k for k in args.rows if k in runs):
        for prompt, row in zip(prompts, results["contexts"]):
            row[key] = runs[key](prompt)
            log(f"context {row['context']}: {key} {row[key]}")
            save()
    status = 0
    if "oracle" in args.rows:
        results["oracle"] = oracle_check(target, drafter, device, args)
        log(f"oracle: {results['oracle']}")
        if not results["oracle"]["ok"]:
            status = _common.fail(f"forced acceptance: the first tokens differ from the target's: {results['oracle']}")
    if "batch" in args.rows:
        from bench.batch import check

        results["batch"] = batch_sweep(target, drafter, args, log)
        bad = check(results["batch"], exact=dtype == torch.float32)
        if bad:
            status = _common.fail("; ".join(bad))
        save()
    save()
    print(report(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
