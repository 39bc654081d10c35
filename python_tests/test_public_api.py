"""The public API is exported once, from the package root; the 0.1 paths the README showed
(``dflash_ext.drafter``, ``.decoding``, ``.models``, ``.proposer``, the root's ``reference`` and
``hardware``, ``DFlashDrafter.as_assistant``) keep working for one release, each use warning
(DeprecationWarning) with the import that replaces it (dflash_ext/_deprecated.py), which
loads only when one is used."""
import importlib
import subprocess
import sys

import pytest

import dflash_ext
from dflash_ext._deprecated import MOVED, OLD_NAMES, REMOVED_IN
from dflash_ext.testing.targets import tiny_target

README_NAMES = ("DFlashDrafter", "spec_generate", "target_generate", "load_default_target", "default_drafter_path",
                "DFlashConfig", "GenerationResult", "DFlashAssistant", "rms_norm", "qk_norm_rope", "project_features",
                "inject_context_kv", "block_attention", "skinny_linear", "block_conv", "ops", "info")


def test_the_root_exports_the_public_api():
    assert set(README_NAMES) <= set(dflash_ext.__all__)
    for name in dflash_ext.__all__:
        assert getattr(dflash_ext, name) is not None, name
    assert set(dflash_ext.__all__) <= set(dir(dflash_ext))
    assert dflash_ext.rms_norm is dflash_ext.ops.rms_norm
    with pytest.warns(DeprecationWarning, match=r"use `from dflash_ext.ops import reference`"):
        assert dflash_ext.reference is importlib.import_module("dflash_ext.ops.reference")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        dflash_ext.nothing


def test_importing_the_package_loads_no_decoding_side():
    """The root's decoding names load on first use: `import dflash_ext` (the ops) stays light."""
    code = "import sys, dflash_ext; print('transformers' in sys.modules, 'dflash_ext.decode.loop' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_importing_the_package_loads_no_old_path():
    """`import dflash_ext` installs the old paths' finder and nothing else of them: no old
    module made, no module of model/ (as_assistant's class), no transformers."""
    code = "import sys, dflash_ext; print(sorted(sys.modules))"
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert {m.split(".")[1] for m in loaded if m.startswith("dflash_ext.")} == {"_C", "_deprecated", "ops"}
    assert "dflash_ext.model.drafter" not in loaded and not any(m.split(".")[0] == "transformers" for m in loaded)


@pytest.mark.parametrize("old,new", sorted(OLD_NAMES.items()))
def test_each_old_name_of_a_module_warns_with_its_one_path_and_resolves(old, new):
    module = importlib.import_module(f"dflash_ext.{new}")
    with pytest.warns(DeprecationWarning) as record:
        value = getattr(dflash_ext, old)
    assert value is module
    (warning,) = record
    assert str(warning.message) == (f"dflash_ext.{old} is deprecated and goes in 0.3: "
                                    f"use `from dflash_ext.ops import {old}`")
    assert warning.filename == __file__  # it points at the caller
    assert old not in dflash_ext.__all__ and old not in dir(dflash_ext)


@pytest.mark.parametrize("old,name,new", [(o, n, m) for o, names in MOVED.items() for n, m in names.items()])
def test_each_old_path_warns_with_its_new_import_and_resolves(old, name, new):
    module = importlib.import_module(f"dflash_ext.{old}")
    with pytest.warns(DeprecationWarning) as record:
        value = getattr(module, name)
    new, _, renamed = new.partition(":")  # "module:new name": renamed there
    renamed = renamed or name
    assert value is getattr(importlib.import_module(f"dflash_ext.{new}"), renamed)
    (warning,) = record
    replacement = f"from dflash_ext import {renamed}" if renamed in dflash_ext.__all__ \
        else f"from dflash_ext.{new} import {renamed}"
    assert str(warning.message) == f"dflash_ext.{old} is deprecated and goes in 0.3: use `{replacement}`"
    assert warning.filename == __file__  # it points at the caller


def test_the_old_from_imports_warn_and_resolve():
    with pytest.warns(DeprecationWarning, match="use `from dflash_ext import DFlashDrafter`"):
        from dflash_ext.drafter import DFlashDrafter
    assert DFlashDrafter is dflash_ext.DFlashDrafter
    with pytest.warns(DeprecationWarning, match="use `from dflash_ext import spec_generate`"):
        from dflash_ext.decoding import spec_generate
    assert spec_generate is dflash_ext.spec_generate
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        importlib.import_module("dflash_ext.models").nothing


_OLD_MODULE_CHECK = """
import importlib, importlib.util, pydoc, sys
import dflash_ext
from dflash_ext._deprecated import MOVED
for old, names in sorted(MOVED.items()):
    path, name = f"dflash_ext.{old}", sorted(names)[0]
    where, _, renamed = names[name].partition(":")
    new = getattr(importlib.import_module(f"dflash_ext.{where}"), renamed or name)
    spec = importlib.util.find_spec(path)  # before any import: it raised (no __spec__)
    via_attribute = getattr(getattr(dflash_ext, old), name)  # no import first: an AttributeError
    module = importlib.import_module(path)
    text = pydoc.render_doc(module)
    print(old, spec.name == path, via_attribute is new, module.__spec__.name == path,
          dflash_ext.__dict__[old] is module is sys.modules[path], importlib.import_module(path) is module,
          set(names) <= set(dir(module)), "Deprecated" in text and name in text)
"""


def test_an_old_module_behaves_as_a_module():
    """Each 0.1 module is a module (issue 67): find_spec finds it, the package's attribute
    imports it, an import sets it on the package, pydoc renders it, dir lists its names; a
    first import in a fresh interpreter, as a user's script does it."""
    out = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", _OLD_MODULE_CHECK],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [f"{old} True True True True True True True" for old in sorted(MOVED)]


def test_the_old_modules_are_not_made_before_they_are_used():
    code = "import sys, dflash_ext; print(any(m.split('.')[1:2] == [o] for o in %r for m in sys.modules))" % (
        sorted(MOVED),)
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["False"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dflash_ext.nothing")


def test_as_assistant_warns_and_returns_the_assistant():
    target = tiny_target()
    drafter = dflash_ext.DFlashDrafter.from_target(target.config, num_layers=1, block_size=4)
    with pytest.warns(DeprecationWarning, match=r"use `dflash_ext.DFlashAssistant\(drafter, target\)`"):
        assistant = drafter.as_assistant(target, draft_window=8)
    assert isinstance(assistant, dflash_ext.DFlashAssistant) and assistant.drafter is drafter
    assert assistant.draft_window == 8


def test_the_old_paths_go_in_the_release_they_name():
    """The promise kept: the release that reaches REMOVED_IN deletes dflash_ext/_deprecated.py
    (its import in the root, its tests here) instead of carrying it further."""
    def release(version):
        return tuple(int(p) for p in version.split(".")[:2])
    assert release(dflash_ext.__version__) < release(REMOVED_IN), "remove dflash_ext/_deprecated.py in this release"


def test_the_suite_itself_fails_on_a_deprecated_path():
    """pyproject.toml's filterwarnings: outside pytest.warns, a deprecated path is an error here."""
    with pytest.raises(DeprecationWarning):
        importlib.import_module("dflash_ext.proposer").DFlashProposer
