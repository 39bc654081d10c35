"""export --for vllm (dflash_ext.model.vllm_format): the draft vocabulary in the form vLLM's
DFlash loader reads (top-level draft_vocab_size, d2t, lm_head.weight), beside our own; the
folder loads back into DFlashDrafter.from_pretrained as the same drafter. No vLLM needed
(python_tests/serving/test_vllm.py runs the folder in vLLM)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ext import DFlashDrafter, DFlashProposer
from dflash_ext.cli.main import main
from dflash_ext.model.checkpoint import DRAFT_VOCAB_NAME
from dflash_ext.model.vllm_format import save_for_vllm
from dflash_ext.testing.targets import tiny_target

PROMPT = list(range(40, 61))


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture
def drafter(target):
    d = DFlashDrafter.from_target(target.config, num_layers=2, block_size=4)
    d.set_draft_vocab(list(range(3, target.config.vocab_size, 3)))
    return d


def _head(target):
    return target.get_output_embeddings().weight


def _drafts(target, drafter):
    """The proposer's block after the prompt's context is injected."""
    prop = DFlashProposer(drafter, target, capacity=64)
    out = target(torch.tensor([PROMPT]), output_hidden_states=True)
    prop.accept(out.hidden_states, slice(0, len(PROMPT) - 1), torch.arange(len(PROMPT) - 1))
    return prop.propose(PROMPT[-1], len(PROMPT) - 1, 3)


def test_the_files_hold_vllms_fields_beside_ours(target, drafter, tmp_path):
    save_for_vllm(drafter, tmp_path, _head(target), dtype=torch.bfloat16)
    config = json.load(open(tmp_path / "config.json"))
    ids = drafter.draft_vocab
    K = ids.numel()
    # vLLM: qwen3_dflash.py DFlashQwen3ForCausalLM reads the top-level field; we read dflash_config's
    assert config["draft_vocab_size"] == config["dflash_config"]["draft_vocab_size"] == K
    assert json.load(open(tmp_path / DRAFT_VOCAB_NAME))["token_ids"] == ids.tolist()
    tensors = load_file(tmp_path / "model.safetensors")
    # draft row i is target token i + d2t[i] (vLLM's compute_logits)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(torch.arange(K) + tensors["d2t"], ids)
    # the target's head rows exactly, in the head's dtype, while the drafter's weights are bf16
    assert tensors["lm_head.weight"].dtype == torch.float32
    assert torch.equal(tensors["lm_head.weight"], _head(target).detach()[ids])
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert "t2d" not in tensors  # vLLM skips it


def test_round_trip_is_the_same_drafter(target, drafter, tmp_path):
    save_for_vllm(drafter, tmp_path, _head(target))
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    original = drafter.state_dict()
    assert set(loaded.state_dict()) == set(original)  # vLLM's two tensors are not the drafter's
    assert all(torch.equal(t, original[name]) for name, t in loaded.state_dict().items())
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    assert loaded.config == drafter.config
    drafts = _drafts(target, loaded)
    assert torch.equal(drafts, _drafts(target, drafter))
    assert set(drafts.tolist()) <= set(drafter.draft_vocab.tolist())


def test_a_drafter_without_a_draft_vocabulary_is_the_reference_format(target, drafter, tmp_path):
    drafter.set_draft_vocab(None)
    save_for_vllm(drafter, tmp_path, None)
    assert "draft_vocab_size" not in json.load(open(tmp_path / "config.json"))
    assert not {"d2t", "lm_head.weight"} & set(load_file(tmp_path / "model.safetensors"))
    assert DFlashDrafter.from_pretrained(str(tmp_path)).draft_vocab is None


def test_bad_arguments_name_the_argument(target, drafter, tmp_path):
    with pytest.raises(ValueError, match="lm_head_weight: the drafter has a draft vocabulary"):
        save_for_vllm(drafter, tmp_path / "a", None)
    with pytest.raises(ValueError, match=r"lm_head_weight has shape \(5, 7\)"):
        save_for_vllm(drafter, tmp_path / "b", torch.zeros(5, 7))
    bad = _head(target).detach().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="lm_head_weight has non-finite"):
        save_for_vllm(drafter, tmp_path / "c", bad)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def _rewrite(path, config_edit=None, tensors_edit=None):
    if config_edit:
        config = json.load(open(path / "config.json"))
        config_edit(config)
        json.dump(config, open(path / "config.json", "w"))
    if tensors_edit:
        tensors = load_file(path / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("edit,match", [
    (dict(tensors_edit=lambda t: t.__setitem__("d2t", t["d2t"] + 1)), "d2t maps the draft rows to other tokens"),
    (dict(tensors_edit=lambda t: t.__setitem__("d2t", t["d2t"].float())), "d2t must be int64"),
    (dict(tensors_edit=lambda t: t.pop("lm_head.weight")), r"lm_head.weight \(present: False\)"),
    (dict(tensors_edit=lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:-1])),
     "lm_head.weight has shape"),
    (dict(tensors_edit=lambda t: t["lm_head.weight"].__setitem__((0, 0), float("inf"))),
     "lm_head.weight has 1 non-finite"),
    (dict(config_edit=lambda c: c.pop("draft_vocab_size")), r"top-level draft_vocab_size \(present: False\)"),
    (dict(config_edit=lambda c: c.__setitem__("draft_vocab_size", 7)), "draft_vocab_size=.* disagree"),
])
def test_inconsistent_vllm_fields_are_clear_errors(target, drafter, tmp_path, edit, match):
    save_for_vllm(drafter, tmp_path, _head(target))
    _rewrite(tmp_path, **edit)
    with pytest.raises(ValueError, match=match):
        DFlashDrafter.from_pretrained(str(tmp_path))


def test_cli_export_for_vllm(target, drafter, tmp_path):
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "src")
    main(["export", "--src", str(tmp_path / "src"), "--dst", str(tmp_path / "dst"), "--for", "vllm",
          "--target", str(tmp_path / "target"), "--dtype", "float32"])
    tensors = load_file(tmp_path / "dst" / "model.safetensors")
    assert torch.equal(tensors["lm_head.weight"], _head(target).detach()[drafter.draft_vocab])
    assert torch.equal(DFlashDrafter.from_pretrained(str(tmp_path / "dst")).draft_vocab, drafter.draft_vocab)


def test_cli_target_only_with_for_vllm(target, drafter, tmp_path, capsys):
    drafter.save_pretrained(tmp_path / "src")
    with pytest.raises(SystemExit):
        main(["export", "--src", str(tmp_path / "src"), "--dst", str(tmp_path / "dst"), "--target", str(tmp_path)])
    assert "argument --target: only --for vllm reads it" in capsys.readouterr().err
