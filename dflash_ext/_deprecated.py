"""The paths of the 0.1 layout that the README showed, kept working for one release (to be
removed in 0.3, :data:`REMOVED_IN`): the modules ``dflash_ext.drafter``, ``dflash_ext.decoding``,
``dflash_ext.models`` and ``dflash_ext.proposer`` (without files: the import system makes
each on its first import or attribute use, :class:`_OldPaths`, and each name it held
resolves to its new home), the root's ``reference`` and ``hardware`` (the modules
``dflash_ext.ops.reference`` and ``dflash_ext.ops.hardware``: one path each) and
``DFlashDrafter.as_assistant``. Each use warns (DeprecationWarning) and names the import that
replaces it. Nothing of the package uses them; the test suite turns their warning into an
error (pyproject.toml's filterwarnings).

Importing the package installs the finder only (this module imports nothing of the package):
an old module is made, and the module its names moved to imported, on its first use;
``as_assistant`` is set on ``DFlashDrafter`` where 0.1 code reaches the class, on its first
use through the root (``dflash_ext.DFlashDrafter``) or ``dflash_ext.drafter``."""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> {name it held: the module that holds it now, or "module:new name" where it was renamed}
MOVED = {
    "drafter": {
        **dict.fromkeys(("DFlashDrafter",), "model.drafter"),
        **dict.fromkeys(("DFlashConfig",), "model.config"),
        **dict.fromkeys(("DraftCache", "CACHE_ROW_ALIGN", "effective_windows"), "draft.cache"),
        **dict.fromkeys(("BlockConv", "CandidateSelector", "MLP", "Attention", "DecoderLayer", "RMSNorm"),
                        "model.layers"),
        **dict.fromkeys(("context_mask", "block_mask", "windowed_bidirectional_attention"), "model.masks"),
    },
    "decoding": {
        **dict.fromkeys(("spec_generate", "target_generate"), "decode.loop"),
        **dict.fromkeys(("GenerationResult", "prompt_ids", "check_sampling"), "decode.output"),
        **dict.fromkeys(("speculative_step", "DecodeState"), "decode.step"),
        **dict.fromkeys(("sample_token",), "sampling"),
        **dict.fromkeys(("choose_block_size", "BlockSizeChoice"), "decode.autotune"),
    },
    "models": dict.fromkeys(("DEFAULT_TARGET_NAME", "EMBEDDED_TARGET_PACKAGE", "MissingPackage", "default_target_path",
                             "default_drafter_path", "load_default_target", "load_target", "looks_like_local_path"),
                            "model.pretrained"),
    "proposer": {
        **dict.fromkeys(("DFlashProposer",), "draft.proposer"),
        **dict.fromkeys(("block_embedding",), "draft.head"),
        "draft_tokens": "draft.head:greedy_draft",  # renamed there
        **dict.fromkeys(("capture_cuda_graph",), "draft.graphs"),
    },
}
# the root's old names of modules -> their one path now
OLD_NAMES = {"reference": "ops.reference", "hardware": "ops.hardware"}
REMOVED_IN = "0.3"


def _new_import(package: str, public, module: str, name: str) -> str:
    return f"from {package} import {name}" if name in public else f"from {package}.{module} import {name}"


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import system's finder and loader of the old modules: ``import dflash_ext.decoding``
    makes a real module (a spec, set on the package as an import sets it) whose names resolve
    on first use, each use warning with its new import."""

    def __init__(self, package: str, public):
        self.package, self.public = package, public

    def find_spec(self, fullname, path=None, target=None):
        parent, _, old = fullname.rpartition(".")
        if parent != self.package or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin="deprecated")

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        package, public = self.package, self.public
        moved = MOVED[module.__name__.rpartition(".")[2]]
        module.__doc__ = (f"Deprecated (removed in {REMOVED_IN}): {', '.join(sorted(moved))} live elsewhere now; "
                          "each warns and names its import.")

        def __getattr__(name):
            if name not in moved:
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            where, _, new = moved[name].partition(":")  # "module" or "module:its new name"
            new = new or name
            warnings.warn(f"{module.__name__} is deprecated and goes in {REMOVED_IN}: use "
                          f"`{_new_import(package, public, where, new)}`", DeprecationWarning, stacklevel=2)
            return with_old_methods(name, getattr(importlib.import_module(f"{package}.{where}"), new))

        module.__getattr__ = __getattr__
        module.__dir__ = lambda: sorted(set(vars(module)) | set(moved))
        module.__all__ = sorted(moved)


def _as_assistant(self, target=None, fused: bool = True, draft_window=None):
    """Deprecated (removed in 0.3): ``dflash_ext.DFlashAssistant(drafter, target)``."""
    warnings.warn(f"DFlashDrafter.as_assistant is deprecated and goes in {REMOVED_IN}: use "
                  "`dflash_ext.DFlashAssistant(drafter, target)`", DeprecationWarning, stacklevel=2)
    from .draft.assistant import DFlashAssistant

    return DFlashAssistant(self, target, fused=fused, draft_window=draft_window)


# class -> {its old method: the method}, set on the class at its first use through an old path or the root
OLD_METHODS = {"DFlashDrafter": {"as_assistant": _as_assistant}}


def with_old_methods(name: str, value):
    """`value` (the root's or an old module's `name`), its old methods set on it if it is a
    class that had some."""
    for method, function in OLD_METHODS.get(name, {}).items():
        setattr(value, method, function)
    return value


def old_attribute(package: str, public, name: str):
    """The root's attribute `name` that only the old paths hold: an old module (imported, so
    also set on the root, as ``import`` sets it) or an old name of a module (warns); else an
    AttributeError."""
    if name in MOVED:
        return importlib.import_module(f"{package}.{name}")
    if name in OLD_NAMES:
        parent, _, leaf = OLD_NAMES[name].rpartition(".")
        warnings.warn(f"{package}.{name} is deprecated and goes in {REMOVED_IN}: use "
                      f"`{_new_import(package, public, parent, leaf)}`", DeprecationWarning, stacklevel=3)
        return importlib.import_module(f"{package}.{OLD_NAMES[name]}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def install(package: str, public) -> None:
    """Let the old modules of `package` be imported (`public`: the names its root exports):
    a finder that makes each on its first import, nothing made or imported before."""
    if not any(isinstance(f, _OldPaths) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_OldPaths(package, public))
