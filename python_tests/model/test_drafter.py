"""DFlashDrafter: config and checkpoint format, cache, fused vs reference draft step."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dflash_ext import DFlashConfig, DFlashDrafter
from dflash_ext.draft.runtime import DraftRuntime
from dflash_ext.model.checkpoint import write_acceptance
from dflash_ext.model.config import default_target_layer_ids
from dflash_ext.testing.targets import tiny_target_config


def test_default_target_layers_match_the_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


def test_default_target_layers_stay_inside_a_small_target():
    """Below 4 layers the reference's rule reaches below layer 0 ([-1, 1] for 2 layers): kept in [0, L)."""
    for L in range(1, 12):
        for k in range(1, 8):
            ids = default_target_layer_ids(L, k)
            assert ids and ids == sorted(set(ids)) and all(0 <= i < L for i in ids), (L, k, ids)
            DFlashConfig.for_target(tiny_target_config("llama", num_hidden_layers=L), num_layers=k)  # a valid config
    assert default_target_layer_ids(2, 2) == [0, 1] and default_target_layer_ids(1, 3) == [0]
    for bad in ((0, 2), (4, 0), (-1, 1), (True, 2), (4, 2.0)):
        with pytest.raises(ValueError, match="num_target_layers|k must"):
            default_target_layer_ids(*bad)
    for bad in (0, -1, 2.0, True):  # the drafter's layers, named as from_target's argument
        with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
            DFlashDrafter.from_target(tiny_target_config("llama"), num_layers=bad)


def _drafter(**kw):
    return DFlashDrafter.from_target(tiny_target_config("llama"), num_layers=2, block_size=8, **kw)


def _draft(drafter, fused, ctx_len=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = drafter.config
    runtime = DraftRuntime(drafter, 64, fused=fused)
    feats = [torch.randn(ctx_len, c.hidden_size, generator=g) for _ in c.target_layer_ids]
    runtime.add_context(0, feats, torch.arange(ctx_len))
    embeds = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    positions = torch.arange(ctx_len, ctx_len + c.block_size)[None]
    return runtime.draft_hidden(embeds, positions), runtime.cache


def test_fused_and_reference_draft_agree():
    drafter = _drafter()
    fused, cache_f = _draft(drafter, True)
    ref, cache_r = _draft(drafter, False)
    torch.testing.assert_close(cache_f.k, cache_r.k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache_f.v, cache_r.v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
    assert cache_f.lengths == (11,)


def test_save_load_round_trip(tmp_path):
    drafter = _drafter(seed=3)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    assert loaded.config == drafter.config
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    torch.testing.assert_close(_draft(loaded, True)[0], _draft(drafter, True)[0], rtol=0, atol=0)


def _reference_checkpoint(path, c: DFlashConfig, drop=None, extra=None, bad_shape=None):
    """A checkpoint written the way the reference implementation writes it."""
    H, D, N = c.hidden_size, c.head_dim, c.num_hidden_layers
    g = torch.Generator().manual_seed(7)
    shapes = {"fc.weight": (H, len(c.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(N):
        a = f"layers.{i}.self_attn."
        shapes.update({a + "q_proj.weight": (c.num_attention_heads * D, H),
                       a + "k_proj.weight": (c.num_key_value_heads * D, H),
                       a + "v_proj.weight": (c.num_key_value_heads * D, H),
                       a + "o_proj.weight": (H, c.num_attention_heads * D),
                       a + "q_norm.weight": (D,), a + "k_norm.weight": (D,),
                       f"layers.{i}.mlp.gate_proj.weight": (c.intermediate_size, H),
                       f"layers.{i}.mlp.up_proj.weight": (c.intermediate_size, H),
                       f"layers.{i}.mlp.down_proj.weight": (H, c.intermediate_size),
                       f"layers.{i}.input_layernorm.weight": (H,),
                       f"layers.{i}.post_attention_layernorm.weight": (H,)})
    if bad_shape:
        shapes[bad_shape] = tuple(s + 1 for s in shapes[bad_shape])
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items() if k != drop}
    if extra:
        state[extra] = torch.randn(3)
    save_file(state, str(path / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "num_hidden_layers": N, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": D,
           "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
           "max_position_embeddings": 40960, "block_size": c.block_size,
           "num_target_layers": c.num_target_layers, "layer_types": ["full_attention"] * N,
           "dflash_config": {"target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id}}
    (path / "config.json").write_text(json.dumps(cfg))
    return state


def test_loads_a_reference_format_checkpoint(tmp_path):
    c = _drafter().config
    state = _reference_checkpoint(tmp_path, c)
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    assert loaded.config.rope_theta == 1e6 and loaded.config.sliding_window is None
    assert loaded.config.target_layer_ids == c.target_layer_ids
    torch.testing.assert_close(loaded.layers[1].self_attn.k_norm.weight, state["layers.1.self_attn.k_norm.weight"])
    torch.testing.assert_close(loaded.fc.weight, state["fc.weight"])


@pytest.mark.parametrize("kind,match", [
    ("missing", "missing.*layers.0.mlp.up_proj.weight"),
    ("unexpected", "unexpected.*embed_tokens.weight"),
    ("shape", "fc.weight has shape"),
])
def test_bad_checkpoints_are_clear_errors(tmp_path, kind, match):
    c = _drafter().config
    _reference_checkpoint(tmp_path, c, drop="layers.0.mlp.up_proj.weight" if kind == "missing" else None,
                          extra="embed_tokens.weight" if kind == "unexpected" else None,
                          bad_shape="fc.weight" if kind == "shape" else None)
    with pytest.raises(ValueError, match=match):
        DFlashDrafter.from_pretrained(str(tmp_path))


def test_missing_checkpoint_pieces(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        DFlashDrafter.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDrafter.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashDrafter.from_pretrained(str(tmp_path))


def test_full_context_cache_is_an_error():
    drafter = _drafter()
    runtime = DraftRuntime(drafter, 4)
    feats = [torch.randn(3, drafter.config.hidden_size) for _ in drafter.config.target_layer_ids]
    runtime.add_context(0, feats, torch.arange(3))
    with pytest.raises(RuntimeError, match="cache is full"):
        runtime.add_context(0, feats, torch.arange(3, 6))
    assert runtime.cache.lengths == (3,)


def test_drafter_that_does_not_fit_the_target():
    drafter = _drafter()
    other = tiny_target_config("llama", hidden_size=96)
    with pytest.raises(ValueError, match="hidden size"):
        drafter.check_fits(other)
    with pytest.raises(ValueError, match="target layers"):
        drafter.check_fits(tiny_target_config("llama", num_hidden_layers=3))


def test_acceptance_profile_travels_with_the_checkpoint(tmp_path):
    d = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4)
    d.acceptance_profile = [0.5, 0.25, 0.1]
    d.save_pretrained(tmp_path)
    assert DFlashDrafter.from_pretrained(str(tmp_path)).acceptance_profile == [0.5, 0.25, 0.1]
    (tmp_path / "acceptance.json").write_text(json.dumps({"accept": [0.5, 1.5]}))
    with pytest.raises(ValueError, match="block_size - 1 = 3"):
        DFlashDrafter.from_pretrained(str(tmp_path))


def test_the_walked_tau_travels_with_the_profile_and_alone(tmp_path):
    """walked_tau (eval --save-acceptance) is saved and loaded beside the profile, also into an
    existing folder whose weights stay (write_acceptance), and never without a profile."""
    d = DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4)
    d.acceptance_profile, d.walked_tau = [0.5, 0.25, 0.1], [1.4, 1.55, 1.6]
    d.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    assert (loaded.acceptance_profile, loaded.walked_tau) == ([0.5, 0.25, 0.1], [1.4, 1.55, 1.6])
    (tmp_path / "README.md").write_text("model card")
    weights = (tmp_path / "model.safetensors").read_bytes()
    write_acceptance(str(tmp_path), [0.4, 0.2, 0.05], [1.3, 1.4, 1.45])
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    assert (loaded.acceptance_profile, loaded.walked_tau) == ([0.4, 0.2, 0.05], [1.3, 1.4, 1.45])
    assert (tmp_path / "model.safetensors").read_bytes() == weights and (tmp_path / "README.md").exists()
    with pytest.raises(ValueError, match="'walked_tau' must hold block_size - 1 = 3"):
        write_acceptance(str(tmp_path), [0.4, 0.2, 0.05], [1.3, 1.4])  # checked before it replaces the file
    assert DFlashDrafter.from_pretrained(str(tmp_path)).walked_tau == [1.3, 1.4, 1.45]
    assert sorted(os.listdir(tmp_path)) == ["README.md", "acceptance.json", "config.json", "model.safetensors"]
    with pytest.raises(FileNotFoundError, match="no config.json"):
        write_acceptance(str(tmp_path / "nowhere"), [0.4, 0.2, 0.05])
    d.acceptance_profile = None
    with pytest.raises(ValueError, match="walked_tau .* needs one"):
        d.save_pretrained(tmp_path / "other")


def _hub_cache(root, repo_id, drafter):
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<hash>/...}."""
    folder = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    drafter.save_pretrained(folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)


def test_from_pretrained_resolves_a_repo_id_through_the_local_hub_cache(tmp_path, monkeypatch):
    d = _drafter()
    _hub_cache(tmp_path, "someone/tiny-dflash", d)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = DFlashDrafter.from_pretrained("someone/tiny-dflash", cache_dir=str(tmp_path), dtype="bfloat16")
    assert loaded.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.fc.weight.float(), d.fc.weight.bfloat16().float())
    with pytest.raises(FileNotFoundError, match="nor in the local Hugging Face cache"):
        DFlashDrafter.from_pretrained("someone/absent", cache_dir=str(tmp_path), local_files_only=True)
    with pytest.raises(ValueError, match="not a torch dtype"):
        DFlashDrafter.from_pretrained("someone/tiny-dflash", cache_dir=str(tmp_path), dtype="float13")
    assert DFlashDrafter.from_pretrained("someone/tiny-dflash", cache_dir=str(tmp_path), dtype="auto",
                                         device="cpu").fc.weight.dtype == d.fc.weight.dtype


def test_default_mask_token_rule():
    from types import SimpleNamespace

    from dflash_ext.model.config import default_mask_token_id

    class Tok(SimpleNamespace):
        def __len__(self):
            return self.n

    assert default_mask_token_id(100, Tok(n=90, mask_token_id=None)) == 90   # first row no token uses
    assert default_mask_token_id(100, Tok(n=100, mask_token_id=7)) == 7      # the tokenizer's own
    assert default_mask_token_id(100, Tok(n=100, mask_token_id=None)) == 99  # nothing better: the last id
    assert default_mask_token_id(100) == 99
