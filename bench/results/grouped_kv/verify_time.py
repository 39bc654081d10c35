"""Verify ms per DFlash step (bf16, B = 3) on the first ShareGPT prompt cut at argv[2] tokens.
Usage: [TRANSFORMERS_SDPA_FORCE_GQA=0|1] python verify_time.py bfloat16 200"""
import os, sys, torch
from dflash_ext import spec_generate, load_target, DFlashDrafter
from dflash_ext.prompts import load_prompts
from dflash_ext.training.data import chat_prompt_ids
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1])
target, tok = load_target(None, dtype=dtype)
drafter = DFlashDrafter.from_pretrained("dflash_ext/drafters/smollm2-135m", dtype=dtype).eval()
ids = torch.tensor([chat_prompt_ids(tok, load_prompts("sharegpt", 1)[0])[:int(sys.argv[2])]])
spec_generate(target, drafter, ids, 16, block_size=3)
res = []
for _ in range(3):
    out = spec_generate(target, drafter, ids, 96, block_size=3)
    s = out.summary(); res.append(s["verify_s"] / s["steps"] * 1e3)
print(os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"), sys.argv[1:], "verify ms/step", [round(r, 2) for r in res], "tau", s["tau"], out.tokens[-8:] if hasattr(out, "tokens") else "")
