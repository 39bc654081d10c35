"""The package's rooms import downward only: each module may import (at the top or
inside a function) only the modules listed before it here. A new module takes its
place in this list. No module of the package is over MAX_LINES lines, and neither the
package nor the benchmarks import the tests."""
import ast
import os

import dflash_ext

ORDER = [
    "_cpu_check", "hardware", "ops", "reference", "testing",
    "testing_targets",  # tiny random targets of every model family (tests and benchmarks)
    "prompts", "models",
    "config_fields",    # the config-field rules: what each config.json key does, types and ranges, rejections
    "config",           # DFlashConfig: its field checks across fields, derived per-layer properties, for_target
    "checkpoint",       # checkpoint files: resolve, read, write
    "hf_assistant",     # transformers' DFlash generate (drives the drafter it is given)
    "diagnostics",      # dflash_ext.info(): what was built and what runs here
    "drafter_layers",   # RMSNorm, Attention, MLP, DecoderLayer, BlockConv, CandidateSelector
    "draft_cache",      # DraftCache (the context cache), effective_windows
    "drafter_masks",    # context_mask, block_mask, windowed_bidirectional_attention
    "draft_step",       # rope tables, stacked K/V weights, add_context, draft_hidden
    "drafter_training",  # the differentiable forward over many blocks
    "drafter",          # DFlashDrafter: build, load, save, draft vocabulary, DFlash2 conversion
    "rollback",         # CacheRollback: the target cache after a rejection, every cache kind
    "target",           # the Hugging Face target adapter, static cache, compiled passes, streamed linear layers
    "proposer",         # DFlashProposer, CUDA-graph capture, draft tokens
    "decoding",         # the step, the loop, sampling, results, choose_block_size
    "timing",           # the target alone timed (the demo's --dtype auto and --baseline)
    "training.recipe", "training.data",
    "training.train_config",  # TrainConfig and the resume rules of --out
    "training.loss",    # sequence_loss and its parts
    "training.trainer",  # the loop, evaluation, data splits
    "cli.args",         # typed arguments, usage errors
    "cli.generate",     # generate, info
    "cli.training",     # gen-data, train, eval, export
    "cli.main",         # the parser
    "__main__",
]
MAX_LINES = 450
PACKAGE = os.path.dirname(dflash_ext.__file__)
ROOT = os.path.dirname(PACKAGE)


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


def test_no_module_is_over_max_lines():
    long = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > MAX_LINES:
                    long[os.path.relpath(path, ROOT)] = lines
    assert long == {}


def _imports_the_tests(path) -> bool:
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if any(n == "python_tests" or n.startswith("python_tests.") for n in names):
            return True
    return False


def test_package_and_benchmarks_do_not_import_the_tests():
    offenders = []
    for top in ("dflash_ext", "bench"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            offenders += [os.path.relpath(os.path.join(folder, n), ROOT) for n in files
                          if n.endswith(".py") and _imports_the_tests(os.path.join(folder, n))]
    assert offenders == []


def test_the_import_rule_sees_test_imports(tmp_path):  # the parser above finds what it must forbid
    for line in ("from python_tests.helpers import ROOT", "import python_tests.decoding_helpers as h",
                 "def f():\n    from python_tests import helpers"):
        (tmp_path / "m.py").write_text(line + "\n")
        assert _imports_the_tests(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text("from dflash_ext import testing\n")
    assert not _imports_the_tests(tmp_path / "m.py")
