"""The draft runtime outlives a generation (issue 63 item 1): ``spec_generate`` keeps one
proposer per drafter (:func:`~dflash_ext.draft.proposer.kept_proposer`) and resets it, so a
second generation makes no runtime, stacks no weight, gathers no vocabulary head and (CUDA)
captures no graph; a weight replaced between generations is still followed, the kept runtime
never leaks into a copy of the drafter, and no module of the package keeps a tensor."""
import copy
import pickle
import sys

import pytest
import torch

from dflash_ext import DFlashDrafter, spec_generate, target_generate
from dflash_ext.draft import graphs, layers, runtime
from dflash_ext.testing.targets import tiny_target
from python_tests.helpers import HAS_CUDA

PROMPT = [5, 17, 33, 2, 9, 41, 77, 12]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def _drafter(target, seed=1, draft_vocab=None):
    drafter = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4, seed=seed)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    return drafter


class _Counts:
    """How many runtimes, stacked weights and vocabulary heads are made (module attributes
    patched to count their calls)."""

    def __init__(self, monkeypatch):
        self.made = {"runtime": 0, "stack": 0, "vocab_head": 0}
        self._count(monkeypatch, runtime, "DraftRuntime", "runtime")
        self._count(monkeypatch, layers, "_stack_rows", "stack")
        self._count(monkeypatch, runtime, "vocab_head", "vocab_head")

    def _count(self, monkeypatch, module, name, key):
        real = getattr(module, name)
        if isinstance(real, type):
            class Counted(real):
                def __init__(inner, *args, **kwargs):
                    self.made[key] += 1
                    super().__init__(*args, **kwargs)
            monkeypatch.setattr(module, name, Counted)
            monkeypatch.setattr(sys.modules["dflash_ext.draft.proposer"], name, Counted)
            return

        def counted(*args, **kwargs):
            self.made[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)


def test_a_second_generation_makes_nothing_again(target, monkeypatch):
    drafter = _drafter(target, draft_vocab=list(range(0, 128, 2)))
    counts = _Counts(monkeypatch)
    spec_generate(target, drafter, PROMPT, 24)
    assert counts.made == {"runtime": 1, "stack": 4, "vocab_head": 1}  # 2 layers x (q/k/v, gate/up)
    for prompt, budget in ((PROMPT[:5], 30), (PROMPT, 24), (PROMPT[::-1], 200)):  # 200: a larger bound
        counts.made = dict.fromkeys(counts.made, 0)
        out = spec_generate(target, drafter, prompt, budget)
        assert counts.made == {"runtime": 0, "stack": 0, "vocab_head": 0}
        assert out.tokens == target_generate(target, prompt, budget).tokens


def test_a_weight_replaced_between_generations_is_drafted_with(target):
    """A parameter given a new tensor (not a view of the stacked rows any more) and a head row
    written in place are both read by the next generation: it drafts what a fresh drafter
    with the same weights drafts (the acceptance lengths are the drafts' fingerprint)."""
    drafter = _drafter(target)
    spec_generate(target, drafter, PROMPT, 20)
    mlp = drafter.layers[1].mlp
    mlp.gate_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.gate_proj.weight))
    with torch.no_grad():
        drafter.layers[0].self_attn.q_proj.weight.mul_(-1)
    fresh = DFlashDrafter(drafter.config)
    fresh.load_state_dict(drafter.state_dict())
    got, want = spec_generate(target, drafter, PROMPT, 40), spec_generate(target, fresh, PROMPT, 40)
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths


def test_another_target_dtype_or_batch_makes_another_proposer(target, monkeypatch):
    drafter = _drafter(target)
    counts = _Counts(monkeypatch)
    spec_generate(target, drafter, PROMPT, 8)
    other = tiny_target("qwen3")
    spec_generate(other, drafter, PROMPT, 8)
    spec_generate(target, drafter, [PROMPT, PROMPT[:5]], 8)
    assert counts.made["runtime"] == 3
    spec_generate(target, drafter, [PROMPT[:3], PROMPT[:6]], 8)  # the same batch size: kept
    assert counts.made["runtime"] == 3


def test_the_kept_proposer_is_not_copied_or_pickled_with_the_drafter(target):
    drafter = _drafter(target)
    spec_generate(target, drafter, PROMPT, 8)
    assert drafter.__dict__.get("_kept_proposer") is not None
    for twin in (copy.deepcopy(drafter), pickle.loads(pickle.dumps(drafter))):
        assert "_kept_proposer" not in twin.__dict__
        assert spec_generate(target, twin, PROMPT, 16).tokens == spec_generate(target, drafter, PROMPT, 16).tokens


def _tensors_in(value, depth=0):
    if isinstance(value, torch.Tensor):
        return True
    if depth > 2:
        return False
    if isinstance(value, dict) or hasattr(value, "items") and hasattr(value, "keyrefs"):
        return any(_tensors_in(v, depth + 1) or _tensors_in(k, depth + 1) for k, v in list(value.items()))
    if isinstance(value, (list, tuple, set)):
        return any(_tensors_in(v, depth + 1) for v in value)
    return False


def test_no_module_of_the_package_keeps_a_tensor(target):
    """After generations (one prompt, a batch, a draft vocabulary) no module-level value of
    dflash_ext holds a tensor: every cache lives in an object its caller holds."""
    drafter = _drafter(target, draft_vocab=list(range(0, 128, 2)))
    spec_generate(target, drafter, PROMPT, 12)
    spec_generate(target, drafter, [PROMPT, PROMPT[:4]], 12)
    held = [f"{name}.{attr}" for name, module in list(sys.modules.items()) if name.startswith("dflash_ext")
            for attr, value in vars(module).items() if not isinstance(value, type(sys)) and _tensors_in(value)]
    assert held == []


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_a_second_cuda_generation_captures_no_graph(target, monkeypatch):
    cuda_target = tiny_target("qwen3").cuda()
    drafter = _drafter(cuda_target).cuda()
    captured = []
    real = graphs.capture_cuda_graph

    def counted(fn):
        captured.append(1)
        return real(fn)
    monkeypatch.setattr(graphs, "capture_cuda_graph", counted)
    spec_generate(cuda_target, drafter, PROMPT, 24)
    assert captured
    captured.clear()
    out = spec_generate(cuda_target, drafter, PROMPT, 24)
    assert captured == []
    assert out.tokens == target_generate(cuda_target, PROMPT, 24).tokens
