"""The package's rooms import downward only: each module may import (at the top or
inside a function) only the modules listed before it here. A new module takes its
place in this list."""
import ast
import os

import dflash_ext

ORDER = [
    "_cpu_check", "hardware", "ops", "reference", "testing", "prompts", "models",
    "config",        # DFlashConfig and the config-field rules
    "checkpoint",    # checkpoint files: resolve, read, write
    "hf_assistant",  # transformers' DFlash generate (drives the drafter it is given)
    "diagnostics",   # dflash_ext.info(): what was built and what runs here
    "drafter",       # modules, DraftCache, drafting, training forward
    "rollback",      # CacheRollback: the target cache after a rejection, every cache kind
    "target",        # the Hugging Face target adapter, static cache, compiled passes, streamed linear layers
    "proposer",      # DFlashProposer, CUDA-graph capture, draft tokens
    "decoding",      # the step, the loop, sampling, results, choose_block_size
    "training.recipe", "training.data", "training.trainer",
    "__main__",
]
PACKAGE = os.path.dirname(dflash_ext.__file__)


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                rel = os.path.relpath(os.path.join(folder, name), PACKAGE)[:-3]
                yield rel.replace(os.sep, ".")


def _imports(module: str):
    """The package modules `module` imports (relative or absolute, anywhere in the file)."""
    with open(os.path.join(PACKAGE, *module.split(".")) + ".py") as f:
        tree = ast.parse(f.read())
    package = module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dflash_ext"):
                base = node.module[len("dflash_ext."):] if node.module != "dflash_ext" else ""
            else:
                continue
            targets = [base] if base else []
            targets += [f"{base}.{a.name}" if base else a.name for a in node.names]
            yield from (t for t in targets if t in ORDER)
        elif isinstance(node, ast.Import):
            yield from (a.name[len("dflash_ext."):] for a in node.names
                        if a.name.startswith("dflash_ext.") and a.name[len("dflash_ext."):] in ORDER)


def test_every_module_has_a_place():
    assert sorted(set(_modules()) - set(ORDER)) == []


def test_modules_import_downward_only():
    upward = {m: sorted(i for i in set(_imports(m)) if ORDER.index(i) >= ORDER.index(m))
              for m in _modules() if m in ORDER}
    assert {m: i for m, i in upward.items() if i} == {}


def test_the_check_sees_imports():  # the parser above finds what it must forbid
    assert set(_imports("decoding")) >= {"drafter", "proposer", "target"}
    assert "target" in set(_imports("training.data"))
