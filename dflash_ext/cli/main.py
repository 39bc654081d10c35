"""Command line: ``python -m dflash_ext generate --prompt "..."``.

Runs DFlash speculative decoding on a target (default: the embedded SmolLM2-135M-Instruct)
with a drafter checkpoint (default for the embedded target: the drafter shipped in the
package; otherwise a freshly initialised one, which accepts almost nothing), streaming the
text as it is accepted, then prints the statistics. ``--baseline`` also runs the target
alone the fastest way measured on this machine and compares. ``python -m dflash_ext info``
says what was built and what runs here.
"""
import argparse

from ..sampling import DEFAULT_VERIFY, VERIFY_RULES
from .args import (UsageError, drafter_folder, drafter_init, existing_dir, int_from_2, nonnegative_float,
                   nonnegative_int, output_dir, output_file, parse_block_size, positive_float, positive_int,
                   probability, prompt_text, prompts_file, seed_int, target_name, torch_device, unit_fraction)
from .generate import cmd_generate, cmd_info
from .training import cmd_eval, cmd_export, cmd_gen_data, cmd_train


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_ext", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation with streaming output and statistics")
    g.add_argument("--prompt", type=prompt_text, default="Write a Python function that checks whether a number is prime.")
    g.add_argument("--prompts-file", type=prompts_file, default=None, metavar="FILE",
                   help="many prompts, decoded in batches of --batch-size (each row accepts its own drafts; "
                        "full-attention targets, others at --batch-size 1): one output per prompt, in order (in "
                        "--json too); replaces --prompt. JSONL when its first line starts with '{' (every line an "
                        "object with a \"prompt\" string), else one prompt per line; a line of the other kind is an "
                        "error")
    g.add_argument("--batch-size", type=positive_int, default=8,
                   help="prompts decoded together with --prompts-file; 1 decodes them one at a time, which targets "
                        "with sliding windows or linear attention need (a batch cannot hold their caches)")
    g.add_argument("--target", type=target_name, default=None, help="Hugging Face causal LM folder (default: embedded SmolLM2)")
    g.add_argument("--drafter", type=drafter_folder, default=None, help="DFlash drafter checkpoint folder (reference format); "
                   "default for the embedded target: the one shipped in the package (python -m dflash_ext info)")
    g.add_argument("--fresh-drafter", action="store_true",
                   help="use a freshly initialised drafter even when the trained default exists")
    g.add_argument("--block-size", type=parse_block_size, default="auto",
                   help="verify block size, or auto (default): the best for this machine's measured verify "
                        "cost and the drafter's acceptance profile")
    g.add_argument("--draft-layers", type=positive_int, default=5, help="layers of a freshly initialised drafter")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0)
    g.add_argument("--top-k", type=nonnegative_int, default=0, help="0: off")
    g.add_argument("--top-p", type=probability, default=1.0)
    g.add_argument("--verify", choices=VERIFY_RULES, default=None,
                   help=f"the verify rule at temperature > 0 (both exact): rejection (default; {DEFAULT_VERIFY} is the "
                        "default without --tree-budget; sampled drafts accepted with min(1, p/q)) or match (greedy "
                        "drafts accepted while they equal the target's sample; a tree's rule); no effect at "
                        "temperature 0")
    g.add_argument("--tree-budget", type=nonnegative_int, default=0,
                   help="tree verification: each step verifies the N most probable paths of the draft pass's slots "
                        "in one target pass of N + 1 tokens (exact at every temperature, the match rule); 0: the "
                        "chain (default). One prompt, a fixed --block-size (the tree's depth + 1), no --static-cache")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--static-cache", action="store_true",
                   help="the target's cache is transformers' StaticCache (a rollback lowers its length); on CUDA the "
                        "verify pass of B tokens and the target alone's one-token pass run compiled in CUDA graphs "
                        "(torch.compile reduce-overhead; the first steps compile). Full-attention targets compile, "
                        "Gated-DeltaNet hybrids run the static cache eagerly, sliding-window targets are refused")
    g.add_argument("--baseline", action="store_true",
                   help="also run the target alone the fastest way measured here (dtype and linear path) and compare")
    g.add_argument("--repeats", type=positive_int, default=3,
                   help="with --baseline: DFlash and the target alone each run this many times, alternately, and the "
                        "speedup is the median of the pairs' ratios (a machine's speed drifts from run to run; "
                        "the text streams once; --prompts-file runs its batches once)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target and drafter dtype; auto = with --block-size auto and a trained drafter, the dtype "
                        "in which DFlash is expected fastest here at its best block size (each timed at start), "
                        "else the dtype in which the target alone runs fastest here (timed at start, one token "
                        "per pass)")
    g.add_argument("--device", type=torch_device, default="cpu")
    g.add_argument("--threads", type=positive_int, default=2)
    g.add_argument("--seed", type=seed_int, default=0)
    g.add_argument("--json", type=output_file, default=None, help="write the statistics to this JSON file")
    d = sub.add_parser("gen-data", help="answer training prompts with the target (its own responses) + cache its features")
    d.add_argument("--out", type=output_dir, required=True,
                   help="records folder; an existing one is resumed (its records are kept, their prompts skipped)")
    d.add_argument("--target", type=target_name, default=None)
    d.add_argument("--prompts", default="sharegpt", choices=["sharegpt", "sharegpt-later-turns", "stdlib-code"],
                   help="training prompt source (never an evaluation set; dflash_ext/prompts.py says what each is)")
    d.add_argument("--n", type=positive_int, default=512, help="prompts to answer: the source's first N after --offset")
    d.add_argument("--offset", type=nonnegative_int, default=0, help="skip the source's first OFFSET prompts (e.g. a held-out "
                                                          "slice past the ones trained on)")
    d.add_argument("--max-new-tokens", type=positive_int, default=160)
    d.add_argument("--max-prompt-tokens", type=positive_int, default=256)
    d.add_argument("--batch-size", type=positive_int, default=64)
    d.add_argument("--num-features", type=positive_int, default=5, help="k target layers (default rule)")
    d.add_argument("--layer-ids", type=nonnegative_int, nargs="*", default=None)
    d.add_argument("--no-features", action="store_true",
                   help="responses only (train with --features live: no 5.6 KiB/token feature cache)")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype for generation; auto = bfloat16 where the CPU has bf16 units")
    d.add_argument("--threads", type=positive_int, default=2)
    t = sub.add_parser("train", help="train a DFlash drafter on a gen-data folder (torchrun for data parallel)")
    t.add_argument("--data", type=existing_dir, required=True, help="gen-data folder; its highest ids are the held-out records")
    t.add_argument("--extra-data", type=existing_dir, nargs="*", default=None,
                   help="more gen-data folders (other prompt sources), training only: never held out")
    t.add_argument("--out", type=output_dir, required=True,
                   help="checkpoint folder (reference format); resumes if it has a trainer state")
    t.add_argument("--overwrite", action="store_true",
                   help="train into a non-empty --out that has no trainer state (its files are replaced)")
    t.add_argument("--target", type=target_name, default=None)
    t.add_argument("--num-layers", type=positive_int, default=None,
                   help="drafter layers (default 5; with --init DIR its own count, or more: new layers are appended)")
    t.add_argument("--block-size", type=int_from_2, default=None)
    t.add_argument("--anchors", type=positive_int, default=None, help="anchors per sequence per epoch (paper 512)")
    t.add_argument("--gamma", type=positive_float, default=None)
    t.add_argument("--lr", type=positive_float, default=None)
    t.add_argument("--epochs", type=positive_int, default=None)
    t.add_argument("--batch-size", type=positive_int, default=None, help="global sequences per optimizer step")
    t.add_argument("--max-len", type=int_from_2, default=None)
    t.add_argument("--max-steps", type=positive_int, default=None)
    t.add_argument("--save-every", type=positive_int, default=None)
    t.add_argument("--seed", type=seed_int, default=None)
    t.add_argument("--autocast", default=None, choices=["auto", "bf16", "none"])
    t.add_argument("--features", default=None, choices=["auto", "cached", "live"],
                   help="target features from the folder's cache or a target forward per sequence")
    t.add_argument("--layer-ids", type=nonnegative_int, nargs="*", default=None, help="target layers (default: meta.json or the default rule)")
    t.add_argument("--holdout", type=nonnegative_int, default=None, help="records (highest ids) kept out to measure held-out tau")
    t.add_argument("--eval-every", type=nonnegative_int, default=None, help="steps between held-out tau measurements")
    t.add_argument("--init", type=drafter_init, default=None,
                   help="random (default), target (layers from the target's last layers), or a drafter "
                        "folder to continue from (its weights, a fresh optimizer)")
    t.add_argument("--loss-vocab", type=nonnegative_int, default=None,
                   help="softmax of the loss over the K most frequent response tokens, recorded as the "
                        "checkpoint's draft vocabulary (0 = all)")
    t.add_argument("--dflash2", action="store_const", const=True, default=None,
                   help="train DFlash2 (docs/dflash2.md): a DFlash (v1) --init starts as a DFlash2 drafter "
                        "that drafts exactly as it does (identity convolutions, no transition term)")
    t.add_argument("--selector-rank", type=positive_int, default=None, help="DFlash2 selector rank R (default 256)")
    t.add_argument("--selector-top-k", type=int_from_2, default=None, help="DFlash2 candidates per slot K (default 16)")
    t.add_argument("--selector-alpha", type=nonnegative_float, default=None,
                   help="weight of DFlash2's selector loss (default 1; 0 leaves the selector untrained)")
    t.add_argument("--distill", type=unit_fraction, default=None,
                   help="weight of the cross-entropy to the target's whole next-token distribution (its logits "
                        "over the loss vocabulary, from live features); 1 - DISTILL to its token (default 0)")
    t.add_argument("--eval-stride", type=positive_int, default=None, help="held-out anchors every N response positions")
    t.add_argument("--log-every", type=positive_int, default=None)
    t.add_argument("--device", type=torch_device, default="cpu")
    t.add_argument("--threads", type=positive_int, default=2)
    v = sub.add_parser("eval", help="held-out tau of a drafter on the records a training run holds out")
    v.add_argument("--data", type=existing_dir, required=True)
    v.add_argument("--drafter", type=drafter_folder, required=True)
    v.add_argument("--target", type=target_name, default=None)
    v.add_argument("--holdout", type=positive_int, default=64,
                   help="the highest-id records of --data, less those whose prompt a training record has")
    v.add_argument("--extra-data", type=existing_dir, nargs="*", default=None,
                   help="the run's --extra-data folders: held-out records with one of their prompts are left out")
    v.add_argument("--eval-stride", type=positive_int, default=None,
                   help="held-out anchors every N response positions (default: train's, so both measure one tau)")
    v.add_argument("--save-acceptance", action="store_true",
                   help="write what was measured into --drafter's acceptance.json (its other files stay), which "
                        "--block-size auto reads: the profile and the tokens per step as the loop walks at each "
                        "verify B (needs --eval-stride 1)")
    v.add_argument("--threads", type=positive_int, default=2)
    e = sub.add_parser("export", help="copy a drafter checkpoint (e.g. a training folder) in another dtype")
    e.add_argument("--src", type=drafter_folder, required=True)
    e.add_argument("--dst", type=output_dir, required=True)
    e.add_argument("--overwrite", action="store_true", help="write into a non-empty --dst (its checkpoint is replaced)")
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    e.add_argument("--draft-vocab", type=nonnegative_int, default=None, metavar="K",
                   help="give the drafter a draft vocabulary: the K most frequent response tokens of --data "
                        "(0: remove it); default: keep the source's")
    e.add_argument("--data", type=existing_dir, default=None, help="training data folder of --draft-vocab (gen-data output)")
    e.add_argument("--holdout", type=nonnegative_int, default=64, help="highest-id records of --data left out of the count")
    e.add_argument("--for", dest="engine", choices=["reference", "vllm"], default="reference",
                   help="reference (default): the reference format with our draft vocabulary; vllm: also vLLM's form "
                        "of the draft vocabulary (top-level draft_vocab_size, d2t, lm_head.weight: the target's LM "
                        "head rows), so that vLLM drafts over it (docs/serving.md)")
    e.add_argument("--target", type=target_name, default=None,
                   help="with --for vllm: the Hugging Face target whose LM head rows are written (default: the "
                        "embedded SmolLM2)")
    i = sub.add_parser("info", help="versions, CUDA architectures built and usable, CPU ISA and op paths, the "
                                    "default target and drafter: what a bug report needs")
    i.add_argument("--json", action="store_true", help="the report as JSON")
    args = p.parse_args(argv)
    commands = {"generate": cmd_generate, "gen-data": cmd_gen_data, "train": cmd_train, "eval": cmd_eval,
                "export": cmd_export, "info": cmd_info}
    try:
        if args.command in ("gen-data", "train", "eval"):  # jobs that own their process and its allocator
            from ..ops import hardware

            hardware.keep_freed_memory()
        commands[args.command](args)
    except UsageError as e:
        sub.choices[args.command].error(str(e))
