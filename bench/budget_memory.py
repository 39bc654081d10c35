"""What a large max_new_tokens costs when the answer is short: the peak resident memory and
wall time of one spec_generate call on the embedded SmolLM2 target with the shipped drafter,
against the same answer under a small budget. The drafter's context cache and RoPE tables
grow with what is generated (issue 31, item 7), so the budget should cost nothing.

How to run (from the repository root, with the extension built), one budget per process so
that each peak is its own::

    for n in 128 1000000 1000000000; do OMP_NUM_THREADS=1 .venv/bin/python -m bench.budget_memory $n; done
"""
import argparse
import resource
import time

import torch


def main():
    from dflash_ext import DFlashDrafter, default_drafter_path, load_target, spec_generate, target_generate
    from dflash_ext.ops.hardware import cpu_description

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("max_new_tokens", type=int)
    p.add_argument("--prompt", default="Say hi.")
    p.add_argument("--block-size", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_target(None, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(default_drafter_path(), dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    stops = [tok.eos_token_id]
    alone = target_generate(model, ids, 256, stop_token_ids=stops)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    res = spec_generate(model, drafter, ids, args.max_new_tokens, block_size=args.block_size, stop_token_ids=stops)
    seconds = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB on Linux
    print(f"max_new_tokens={args.max_new_tokens}: {len(res.tokens)} tokens (equal to the target alone's: "
          f"{res.tokens == alone.tokens}), {seconds:.2f} s, peak RSS +{grown:.0f} MiB [{cpu_description()}]")


if __name__ == "__main__":
    main()
