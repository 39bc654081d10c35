"""The house's rules (docs/layout.md), checked on the source:

- the layers import one way, downward: each module may import (at the top or inside a
  function) only the modules listed before it in ORDER; the subpackages and top-level
  modules sit in ORDER in the order of LAYERS, so no module imports a layer above its own,
  and there is no import cycle;
- the root (dflash_ext/__init__.py) is the top: it exports the layers' names (defining none
  itself) and no module imports a name of it, only its modules (``from .. import ops``) and
  the compiled extension ``_C`` (csrc/, below every module);
- at most MAX_TOP_LEVEL modules at the package's top level besides __init__, __main__ and
  the private _deprecated (the old paths, one release), at least MIN_SUBPACKAGES subpackages;
- one path per name: no module imports a name from another module of the package without
  using it (a re-export), except a package's __init__ (the root's public API); at most
  MAX_PRIVATE_IMPORTS private names imported across modules;
- nothing of the package imports its testing helpers (dflash_ext.testing); neither the
  package nor the benchmarks import the tests; the tests mirror the subpackages;
- a module past MAX_LINES lines is a warning: it may have grown past one job (a reason to
  look, not to split by count).
"""
import ast
import os
import warnings

import dflash_ext

LAYERS = ["ops", "testing", "prompts", "model", "sampling", "draft", "decode", "diagnostics", "serving", "training",
          "cli", "_deprecated", "__main__"]
ORDER = [
    "ops.hardware",      # CPU features, the extension's loading, ISA level, dtype choice
    "ops",               # the op API: each op's wrapper and fake kernel
    "ops.reference",     # the plain-PyTorch specification of every op
    "ops.linear",        # which kernel runs each linear layer
    "testing", "testing.inputs", "testing.targets", "testing.oracle",
    "prompts",           # prompt sets (training sources, evaluation sets)
    "model",
    "model.config_fields",  # the config-field rules: what each config.json key does, types and ranges, rejections
    "model.deepspec_config",  # DeepSpec's config.json (DSpark): its fields read and written back
    "model.config",      # DFlashConfig: the checks across fields, derived per-layer properties, for_target
    "model.atomic_files",  # files and folders written whole or not at all
    "model.checkpoint",  # checkpoint files: resolve, read, write
    "model.layers",      # RMSNorm, Attention, MLP, DecoderLayer, BlockConv, CandidateSelector, rope_tables
    "model.masks",       # context_mask, block_mask, windowed_bidirectional_attention
    "model.dspark",      # DSpark's Markov and confidence heads, the block's backbone pass and Markov walk
    "model.drafter",     # DFlashDrafter: weights, load, save, draft vocabulary, the training forward
    "model.pretrained",  # the embedded default target, the shipped drafter's path
    "model.vllm_format",  # the drafter as vLLM's DFlash loader reads it whole (export --for vllm)
    "sampling",          # Sampling (the value a generation samples by), the logit processing, the sampled draft
    "draft",
    "draft.cache",       # DraftCache (the context cache), effective_windows
    "draft.layers",      # the fused decoder layer, the stacked weights it reads
    "draft.head",        # block_embedding, the draft vocabulary's LM head, draft_tokens
    "draft.graphs",      # CUDA graphs of the draft step
    "draft.runtime",     # DraftRuntime: one generation's drafting
    "draft.dspark",      # DSpark / DeepSpec-format drafting in plain PyTorch: dspark_draft, DSparkProposer
    "draft.proposer",    # DFlashProposer: the runtime against one target (spec_generate's)
    "draft.assistant",   # DFlashAssistant: the runtime as transformers' assistant_model
    "decode",
    "decode.rollback",   # CacheRollback: the target cache after a rejection, every cache kind
    "decode.runner",     # TargetRunner, static cache, compiled passes
    "decode.verify",     # the verify rules: rejection sampling, sample-and-match, batched over rows
    "decode.output",     # what the loops share: input checks, a row's output, the phase clock, GenerationResult
    "decode.step",       # speculative_step: draft -> verify -> accept -> roll back -> inject
    "decode.autotune",   # every run-time timing of the decoding: the block size
    "decode.batch",      # batch_generate: many prompts, ragged acceptance, the RaggedCache
    "decode.tree_build",  # the draft tree of one draft pass: the best-first top-N paths, vectorised
    "decode.tree_verify",  # the tree's verify pass (4-D mask), its rule, the accepted path's K/V kept
    "decode.tree",       # tree_step, tree_generate, the tree proposer protocol and DFlashProposer's adapter
    "decode.loop",       # spec_generate, target_generate
    "diagnostics",       # dflash_ext.info(): what was built and what runs here
    "serving", "serving.vllm_plugin",  # vLLM's plugin entry point (imports nothing of vLLM)
    "serving.vllm_model",  # vLLM's DFlash drafter on our fused ops (imported by vLLM only)
    "training", "training.recipe", "training.data",
    "training.train_config",  # TrainConfig and the resume rules of --out
    "training.loss",     # sequence_loss and its parts
    "training.trainer",  # the loop, evaluation, data splits
    "cli",
    "cli.args",          # typed arguments, usage errors
    "cli.demo",          # the demo: the target alone timed, the dtype, DFlash's runs, the baseline, the repeats
    "cli.generate",      # generate (its arguments, the target and drafter loaded), info
    "cli.training",      # gen-data, train, eval, export
    "cli.main",          # the parser
    "_deprecated",       # the old paths, one release
    "__main__",
]
COMPILED = ("_C",)  # the compiled extension (csrc/): below every module, it imports nothing of the package
MAX_TOP_LEVEL = 4
MIN_SUBPACKAGES = 6
MAX_PRIVATE_IMPORTS = 3
MAX_LINES = 450
MAX_RESULTS_LINES = 300  # bench/RESULTS.md holds the current figures; older runs go to its history
PACKAGE = os.path.dirname(dflash_ext.__file__)
ROOT = os.path.dirname(PACKAGE)
TESTS = os.path.join(ROOT, "python_tests")


def _modules():
    """Every module of the package by dotted name (a subpackage's __init__ by the subpackage's;
    the root __init__, the public API over every layer, is not one of them)."""
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), PACKAGE)[:-3].replace(os.sep, ".")
                if rel != "__init__":
                    yield rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _path(module: str) -> str:
    base = os.path.join(PACKAGE, *module.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def _tree(module: str) -> ast.Module:
    with open(_path(module)) as f:
        return ast.parse(f.read())


def _import_froms(module: str):
    """(node, the package module it imports from: "" for the root) of each `from ... import`
    of the package in `module` ("__init__": the root), relative or absolute, anywhere in the file."""
    is_package = _path(module).endswith("__init__.py")
    package = [] if module == "__init__" else module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package[:len(package) - node.level + 1] + ([node.module] if node.module else [])
                yield node, ".".join(parts)
            elif node.module and (node.module == "dflash_ext" or node.module.startswith("dflash_ext.")):
                yield node, node.module[len("dflash_ext."):] if node.module != "dflash_ext" else ""


def _imports(module: str):
    """The package modules `module` imports (relative or absolute, anywhere in the file)."""
    for node, base in _import_froms(module):
        targets = [base] if base else []
        targets += [f"{base}.{a.name}" if base else a.name for a in node.names]
        yield from (t for t in targets if t in ORDER and t != module)
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            yield from (a.name[len("dflash_ext."):] for a in node.names
                        if a.name.startswith("dflash_ext.") and a.name[len("dflash_ext."):] in ORDER)


def _layer(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_a_place():
    assert sorted(set(_modules()) - set(ORDER)) == []
    assert sorted(set(ORDER) - set(_modules())) == []


def test_the_order_lists_the_layers_in_their_order():
    layers = [_layer(m) for m in ORDER]
    seen = [layer for i, layer in enumerate(layers) if i == 0 or layers[i - 1] != layer]
    assert seen == LAYERS  # each layer's modules together, the layers in order


def test_modules_import_downward_only():
    upward = {m: sorted(i for i in set(_imports(m)) if ORDER.index(i) >= ORDER.index(m)) for m in _modules()}
    assert {m: i for m, i in upward.items() if i} == {}


def test_no_subpackage_imports_a_layer_above_its_own():
    up = {m: sorted(i for i in set(_imports(m)) if LAYERS.index(_layer(i)) > LAYERS.index(_layer(m)))
          for m in _modules()}
    assert {m: i for m, i in up.items() if i} == {}


def _root_names(module: str):
    """The names `module` imports from the package root that are not its modules: the root's
    own (its exports, its version), an arrow up to the top."""
    for node, base in _import_froms(module):
        if base == "":
            yield from (a.name for a in node.names if a.name not in ORDER and a.name not in COMPILED)
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name == "dflash_ext")


def test_no_module_imports_a_name_of_the_root():
    assert {m: sorted(set(_root_names(m))) for m in _modules() if any(_root_names(m))} == {}


def test_the_root_exports_and_defines_nothing_itself():
    """Its imports name modules (the ops at import, each lazy name's module on first use); it
    defines only the module hooks that load them: it imports down only, into every layer."""
    defined = sorted(n.name for n in _tree("__init__").body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert defined == ["__dir__", "__getattr__"]
    assert list(_root_names("__init__")) == []
    assert all(base in ORDER for _, base in _import_froms("__init__") if base)
    assert set(dflash_ext._LAZY.values()) <= set(ORDER)


def test_the_root_rule_sees_the_root_s_names(tmp_path, monkeypatch):  # the parser above finds what it must forbid
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import __version__, _C, b\nimport dflash_ext\n"
                                   "def f():\n    from dflash_ext import info\n")
    monkeypatch.setitem(globals(), "PACKAGE", str(tmp_path))
    monkeypatch.setitem(globals(), "ORDER", ["a", "b"])
    assert sorted(_root_names("a")) == ["__version__", "dflash_ext", "info"]


def test_every_import_of_the_package_names_one_of_its_modules():
    """Also those inside functions, which importing the package does not run: a path a move left
    behind fails here, not at the first call."""
    stale = sorted({(m, base) for m in _modules() for _, base in _import_froms(m) if base and base not in ORDER})
    assert stale == []


def test_the_check_sees_imports():  # the parser above finds what it must forbid
    assert set(_imports("decode.loop")) >= {"model.drafter", "draft.proposer", "decode.runner", "ops.linear"}
    assert "decode.runner" in set(_imports("training.data"))
    assert {"ops", "ops.hardware"} <= set(_imports("ops.linear"))  # `from .. import ops`, `from . import hardware`
    assert "ops.hardware" in set(_imports("ops"))  # a subpackage's __init__


def test_the_package_has_few_top_level_modules_and_its_layers_as_subpackages():
    top = sorted(n[:-3] for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert len(set(top) - {"__init__", "__main__", "_deprecated"}) <= MAX_TOP_LEVEL, top
    subpackages = [n for n in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, n, "__init__.py"))]
    assert len(subpackages) >= MIN_SUBPACKAGES, subpackages


def _private_imports():
    return sorted((m, a.name) for m in _modules() for node, _ in _import_froms(m) for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_C")


def test_few_private_names_cross_modules():
    assert len(_private_imports()) <= MAX_PRIVATE_IMPORTS, _private_imports()


def _unused_imports(module: str):
    """Names `module` imports from the package and never uses: a re-export."""
    tree = _tree(module)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    for node, _ in _import_froms(module):
        for a in node.names:
            name = a.asname or a.name
            if name not in used and name not in ("__version__", "_C"):
                yield name


def test_no_module_re_exports_names_of_another():
    # a package's __init__ may: the root's is the public API (exported once), the others import what they run
    shims = {m: sorted(_unused_imports(m)) for m in _modules() if not _path(m).endswith("__init__.py")}
    assert {m: names for m, names in shims.items() if names} == {}


def test_the_rules_see_private_and_re_exported_names(tmp_path, monkeypatch):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .b import _hidden, shown  # noqa\n")
    monkeypatch.setitem(globals(), "PACKAGE", str(tmp_path))
    assert list(_unused_imports("a")) == ["_hidden", "shown"]
    assert _private_imports() == [("a", "_hidden")]


def test_nothing_of_the_package_imports_its_testing_helpers():
    users = {m: sorted(i for i in set(_imports(m)) if _layer(i) == "testing")
             for m in _modules() if _layer(m) != "testing"}
    assert {m: i for m, i in users.items() if i} == {}


def test_the_tests_mirror_the_subpackages():
    subpackages = {n for n in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, n, "__init__.py"))}
    missing = sorted(n for n in subpackages - {"testing"} if not os.path.isfile(os.path.join(TESTS, n, "__init__.py")))
    assert missing == []


def test_a_module_past_max_lines_is_a_warning():
    long = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > MAX_LINES:
                    long[os.path.relpath(path, ROOT)] = lines
    for path, lines in sorted(long.items()):
        warnings.warn(f"{path} has {lines} lines (> {MAX_LINES}): has it grown past one job?", UserWarning)


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
    for line in ("from python_tests.helpers import ROOT", "import python_tests.decode.test_decoding as t",
                 "def f():\n    from python_tests import helpers"):
        (tmp_path / "m.py").write_text(line + "\n")
        assert _imports_the_tests(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text("from dflash_ext.testing import targets\n")
    assert not _imports_the_tests(tmp_path / "m.py")


def test_results_page_holds_only_the_current_figures():
    with open(os.path.join(ROOT, "bench", "RESULTS.md")) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_RESULTS_LINES, (
        f"bench/RESULTS.md has {lines} lines (> {MAX_RESULTS_LINES}): move superseded figures to "
        "bench/results/history/notebook-2026.md")
