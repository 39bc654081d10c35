"""Tokens per step, chain against tree (issue 66): the same prompts decoded greedily by
``spec_generate`` (a chain of depth drafts per step) and by ``spec_generate(tree_budget=N)``
(one draft pass, the best tree of N nodes of its slots, verified in one pass) at each node budget N; tau (mean
tokens per verify step) and the verify pass's length for each, every output checked against
the chain's (greedy: they must be equal in float32).

    python -m bench.tree --out OUT                     # SmolLM2 + the shipped drafter, HumanEval prompts
    python -m bench.tree --tiny --out OUT              # a tiny random target (the smoke test)
    python -m bench.tree --temperature 0.7 --out OUT   # sampled: tau only

Tau is what a tree buys per target pass; whether it pays depends on the cost of a pass of
N + 1 tokens against one of depth + 1 on the device: each run is also timed (tokens per second
over all prompts, after an untimed warm-up of each way), beside the target alone
(``target_generate``) in the same run, so the table's ratios compare like with like.
"""
import argparse
import os

import torch

from bench import _common
from bench.batch import _models  # (target, drafter, prompts, stop tokens): the same models and prompts

BUDGETS = (4, 8, 16, 32, 64)


def tau_chain_vs_tree(target, drafter, prompts, max_new_tokens: int = 64, depth=None, budgets=BUDGETS,
                      stop_token_ids=(), log=print, temperature: float = 0.0, seed: int = 0) -> dict:
    """{"chain": {tau, steps, tokens}, "trees": [{budget, tau, steps, equal}, ...]} over `prompts`
    (lists of ints): tau = new tokens / verify steps over all prompts, `equal` the number of
    prompts whose tree output equals the chain's (greedy: all of them; at `temperature` > 0
    the chain's rule is rejection sampling of sampled drafts, the tree's sample-and-match,
    each run with a generator seeded `seed`: outputs differ, only tau compares)."""
    from dflash_ext import spec_generate, target_generate

    depth = drafter.config.block_size - 1 if depth is None else depth
    sampled = dict(temperature=temperature, generator=torch.Generator().manual_seed(seed))
    for budget in (0, *budgets):  # untimed warm-up of each way: first-call costs out of the timed runs
        spec_generate(target, drafter, prompts[0], 8, block_size=depth + 1, tree_budget=budget, **sampled)
    target_generate(target, prompts[0], 8, **sampled)
    sampled["generator"].manual_seed(seed)
    alone = [target_generate(target, p, max_new_tokens, stop_token_ids=stop_token_ids, **sampled) for p in prompts]
    sampled["generator"].manual_seed(seed)
    chain = [spec_generate(target, drafter, p, max_new_tokens, block_size=depth + 1, stop_token_ids=stop_token_ids,
                           **sampled) for p in prompts]

    def summary(outs):
        steps = sum(len(o.acceptance_lengths) for o in outs)
        tokens = sum(len(o.tokens) for o in outs)
        seconds = sum(o.total_time for o in outs)
        return dict(tau=tokens / max(1, steps), steps=steps, tokens=tokens, seconds=seconds,
                    tok_s=tokens / max(seconds, 1e-9))

    result = dict(depth=depth, prompts=len(prompts), max_new_tokens=max_new_tokens, temperature=temperature,
                  alone=summary(alone), chain=dict(summary(chain), pass_tokens=depth + 1), trees=[])
    log(f"chain (depth {depth}): tau {result['chain']['tau']:.3f}")
    for budget in budgets:
        sampled["generator"].manual_seed(seed)
        outs = [spec_generate(target, drafter, p, max_new_tokens, block_size=depth + 1, tree_budget=budget,
                              stop_token_ids=stop_token_ids, **sampled) for p in prompts]
        row = dict(summary(outs), budget=budget, pass_tokens=budget + 1,
                   equal=sum(o.tokens == c.tokens for o, c in zip(outs, chain)))
        result["trees"].append(row)
        log(f"tree (depth {depth}, {budget} nodes): tau {row['tau']:.3f}, equal {row['equal']}/{len(prompts)}")
    return result


def report(result) -> str:
    greedy = not result["temperature"]  # sampled outputs are not compared: "-"
    alone, chain = result["alone"]["tok_s"], result["chain"]["tok_s"]
    rows = [dict(kind="target alone", nodes=0, pass_tokens=1, tau=1.0, tok_s=alone, vs_chain=alone / chain,
                 vs_alone=1.0, equal=None),
            dict(kind="chain", nodes=result["depth"], pass_tokens=result["chain"]["pass_tokens"],
                 tau=result["chain"]["tau"], tok_s=chain, vs_chain=1.0, vs_alone=chain / alone,
                 equal=result["prompts"] if greedy else None)]
    rows += [dict(kind="tree", nodes=r["budget"], pass_tokens=r["pass_tokens"], tau=r["tau"], tok_s=r["tok_s"],
                  vs_chain=r["tok_s"] / chain, vs_alone=r["tok_s"] / alone,
                  equal=r["equal"] if greedy else None) for r in result["trees"]]
    cols = ["kind", "nodes", ("pass_tokens", "pass tokens", "{}"), ("tau", "tau", "{:.3f}"),
            ("tok_s", "tok/s", "{:.1f}"), ("vs_chain", "x chain", "{:.2f}"), ("vs_alone", "x alone", "{:.2f}"),
            "equal"]
    how = "greedy" if not result["temperature"] else f"T = {result['temperature']:g}"
    return _common.format_table(rows, cols, title=f"depth {result['depth']}, {result['prompts']} prompts, "
                                                  f"{result['max_new_tokens']} new tokens each ({how})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random qwen3 target and a fresh drafter (smoke test)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--dtype", default="float32", choices=["float32"], help="float32: the outputs compared exactly")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=None, help="drafted slots (default: the drafter's block - 1)")
    ap.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: tau only (the outputs are samples)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(_common.OUT_DIR, "tree"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter, prompts, stops = _models(args)
    meta = _common.metadata(torch.device("cpu"), dtype="float32", tiny=args.tiny)
    result = tau_chain_vs_tree(target, drafter, prompts, args.max_new_tokens, args.depth, args.budgets, stops,
                               log=_common.logger(), temperature=args.temperature, seed=args.seed)
    result["metadata"] = meta
    os.makedirs(args.out, exist_ok=True)
    _common.write_json(os.path.join(args.out, "tree.json"), result)
    text = _common.header(meta) + "\n\n" + report(result)
    with open(os.path.join(args.out, "tree.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    bad = [f"{r['budget']} nodes: {len(prompts) - r['equal']} outputs differ "
           "from the chain's" for r in result["trees"] if r["equal"] != len(prompts) and not args.temperature]
    return _common.fail("; ".join(bad)) if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
