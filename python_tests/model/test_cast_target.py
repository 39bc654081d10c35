"""cast_target (dflash_ext/model/pretrained.py): the bf16 copy of a loaded target that the demo,
the autotuner and training make is the model transformers' from_pretrained(dtype=bf16) gives,
every parameter and buffer (its RoPE inverse frequencies in float32, which model.to(bf16) rounds;
what the class keeps in float32, e.g. DeepSeek-V3's router), for every family we decode."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from dflash_ext.model.pretrained import cast_target  # noqa: E402
from dflash_ext.testing.targets import FAMILIES, tiny_family_target  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_cast_target_is_from_pretrained_in_that_dtype(family, tmp_path):
    tiny_family_target(family, 3).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    cast = cast_target(loaded, torch.bfloat16)

    want = dict(expected.named_parameters()) | dict(expected.named_buffers())
    got = dict(cast.named_parameters()) | dict(cast.named_buffers())
    assert got.keys() == want.keys()
    rope = [name for name in want if name.endswith("inv_freq")]
    assert rope, f"{family}: no RoPE buffer found: the test would check nothing of it"
    for name in rope:
        assert got[name].dtype == want[name].dtype == torch.float32, name
    for name, tensor in want.items():  # every parameter and buffer: its dtype and its values
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert cast.state_dict().keys() == expected.state_dict().keys()  # the buffers' persistence kept
    # the source stays the fp32 model it was
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in loaded.state_dict().items())
    ids = torch.arange(1, 40)[None] % 100
    with torch.no_grad():
        assert torch.equal(cast(ids).logits, expected(ids).logits)


def test_model_to_would_round_the_rope_frequencies():
    """Why cast_target exists: .to(bf16) rounds inv_freq (the check above would catch a cast that does)."""
    model = tiny_family_target("llama", 3)
    plain = next(b for n, b in model.to(torch.bfloat16).named_buffers() if n.endswith("inv_freq"))
    assert plain.dtype == torch.bfloat16
