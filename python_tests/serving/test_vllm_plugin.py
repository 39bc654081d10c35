"""The vLLM plugin without vLLM: the entry point vLLM finds, what register() registers, its
off switch, and that nothing of vLLM is imported before vLLM calls it. (With vLLM, the
plugin's drafter serves: test_vllm.py.)"""
import ast
import os
import sys
import tomllib
import types

import pytest

from dflash_ext.serving import vllm_plugin
from python_tests.helpers import ROOT


class FakeRegistry:
    registered = []

    @classmethod
    def register_model(cls, architecture, model):
        cls.registered.append((architecture, model))


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeRegistry.registered = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=FakeRegistry))
    return FakeRegistry


def test_the_entry_point_is_register():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        plugins = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"dflash_ext": "dflash_ext.serving.vllm_plugin:register"}


def test_register_maps_the_dflash_architecture_to_the_fused_drafter(fake_vllm, monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENV_SWITCH, raising=False)
    vllm_plugin.register()
    assert fake_vllm.registered == [("DFlashDraftModel", "dflash_ext.serving.vllm_model:FusedDFlashQwen3ForCausalLM")]
    # the path names a class of that module (read, not imported: importing it imports vLLM)
    module, name = vllm_plugin.MODEL_PATH.split(":")
    with open(os.path.join(ROOT, *module.split(".")) + ".py") as f:
        classes = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef)}
    assert name in classes


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("false", False), ("no", False),
                                      ("1", True), ("", True)])
def test_the_env_switch(fake_vllm, monkeypatch, value, on):
    monkeypatch.setenv(vllm_plugin.ENV_SWITCH, value)
    vllm_plugin.register()
    assert bool(fake_vllm.registered) == on


def test_nothing_of_vllm_is_imported_before_vllm_calls_the_plugin():
    import subprocess

    code = ("import sys, dflash_ext, dflash_ext.serving, dflash_ext.serving.vllm_plugin as p; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "assert 'dflash_ext.serving.vllm_model' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
