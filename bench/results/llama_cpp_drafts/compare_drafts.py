"""Our loop's drafts per step on one bench.e2e prompt (fp32, B = 4), beside llama.cpp's.
Usage: PYTHONPATH=. python drafts_ours.py SET INDEX NEW_TOKENS PROMPT_OUT"""
import sys, torch
from bench.e2e import encode
from dflash_ext import spec_generate, load_target, DFlashDrafter
from dflash_ext.draft.proposer import DFlashProposer
from dflash_ext.prompts import load_prompts
torch.set_num_threads(1)
set_name, idx, new_tokens, prompt_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
target, tok = load_target(None, dtype=torch.float32)
drafter = DFlashDrafter.from_pretrained("dflash_ext/drafters/smollm2-135m", dtype=torch.float32).eval()
ids = encode(tok, load_prompts(set_name, idx + 1)[idx], 1024)
open(prompt_out, "w").write(tok.decode(ids))  # the text llama.cpp tokenizes (bench.llama_cpp does the same)
propose = DFlashProposer.propose
def logged(self, last, pos, n):
    out = propose(self, last, pos, n)
    print("after token", last, "at position", pos, "drafts", out.tolist())
    return out
DFlashProposer.propose = logged
s = spec_generate(target, drafter, torch.tensor([ids]), new_tokens, block_size=4).summary()
drafted = 3 * s["steps"]
accepted = s["new_tokens"] - s["steps"]
print(f"ours: {s['new_tokens']} tokens in {s['steps']} steps, {accepted}/{drafted} drafts accepted "
      f"({100 * accepted / drafted:.1f} %)")
