# greedy_token (dflash_ext/sampling.py) against torch.argmax on bf16 logits on the CPU: torch.utils.benchmark medians.
# Run from the repository root: .venv/bin/python bench/results/greedy_token/argmax_bench.py (output: argmax_bench.txt)
import torch, torch.utils.benchmark as tb
from dflash_ext.sampling import greedy_token
torch.set_num_threads(2)
for shape in ((1, 1, 49152), (1, 4, 49152), (1, 3, 16384)):
    x = torch.randn(shape).bfloat16()
    a = tb.Timer("x.argmax(-1)", globals={"x": x}).blocked_autorange(min_run_time=1).median
    b = tb.Timer("g(x)", globals={"x": x, "g": greedy_token}).blocked_autorange(min_run_time=1).median
    print(f"{shape}: torch bf16 argmax {a*1e6:.0f} us, greedy_token {b*1e6:.0f} us ({a/b:.2f}x)")
