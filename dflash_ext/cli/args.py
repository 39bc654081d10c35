"""The command line's typed arguments (argparse ``type=`` callables) and the usage errors a
command finds once it reads the data or the model's config (:class:`UsageError`)."""
import argparse
import json
import math
import os

import torch


# ---------------------------------------------------------------- argument checks
# argparse `type=` callables: a bad value ends in "argument --FLAG: must be ..., got X" and
# exit status 2 before anything loads (no value outside its range is silently a default).

class UsageError(Exception):
    """A bad argument found by a command (one that needs the data or the model to see it):
    main() reports it as argparse does, with exit status 2."""


def _checked(cast, ok, what):
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse's own messages name the type
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
int_from_2 = _checked(int, lambda v: v >= 2, "an integer >= 2")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")
nonnegative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
probability = _checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]")  # NaN fails too
unit_fraction = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
seed_int = _checked(int, lambda v: 0 <= v < 2 ** 63, "an integer in [0, 2**63)")  # torch.Generator's range


_block_size_int = _checked(int, lambda v: v >= 1, "auto or an integer >= 1")


def parse_block_size(text):
    return text if text == "auto" else _block_size_int(text)


def existing_dir(text):
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    return text


def output_dir(text):
    """A folder to write into: it may exist (what is in it is each command's affair), but as a folder."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def output_file(text):
    """A file the command will write at its end: tried now (opened for appending, and removed
    again if it was not there), so that a path it cannot write fails before the work."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: is a directory" if os.path.isdir(text)
                                         else f"{text}: no such directory {folder}")
    existed = os.path.lexists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({e.strerror})") from None
    if not existed:
        os.remove(text)
    return text


def prompt_text(text):
    """--prompt: text UTF-8 can encode (bytes of the command line that are not UTF-8 reach
    Python as lone surrogates, which the tokenizer would reject with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = text[e.start].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 (byte 0x{byte.hex()} at character {e.start})") from None
    return text


def prompts_file(text):
    """--prompts-file: its prompts (a list of str), read now so that a bad file is a usage error
    before any model loads. One of two kinds, by its first non-blank line: JSONL when that line
    starts with "{" (then every non-blank line is a JSON object with a "prompt" string), else
    plain text, one prompt per line. Blank lines are skipped; a UTF-8 byte-order mark is not
    text. A line that breaks its file's kind (a JSON line that does not parse, a JSON record in
    a text file) is an error naming it: never silently a prompt."""
    try:
        with open(text, encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is dropped
            lines = [line.lstrip("\ufeff") for line in f.read().splitlines()]  # and one at a line's start
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e}") from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise argparse.ArgumentTypeError(f"{text} holds no prompt")
    first = numbered[0][0]
    if numbered[0][1].lstrip().startswith("{"):
        return [_json_prompt(text, number, line, first) for number, line in numbered]
    for number, line in numbered:
        if isinstance(_json_object(line), dict):
            raise argparse.ArgumentTypeError(
                f"line {number} of {text} is a JSON record, but line {first} is plain text: a prompts file is "
                "JSONL (every line a JSON object with a \"prompt\" string) or plain text (one prompt per line), "
                "not both")
    return [line for _, line in numbered]


def _json_object(line):
    """`line` parsed as JSON (None where it does not parse)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def _json_prompt(path, number: int, line: str, first: int) -> str:
    """The "prompt" of line `number` of a JSONL prompts file (its first line, `first`, is JSON)."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"line {number} of {path} is not valid JSON ({e.msg} at column {e.colno}); the file is JSONL (line "
            f"{first} starts with '{{'), so every line must be a JSON object with a \"prompt\" string") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise argparse.ArgumentTypeError(f"line {number} of {path} is " + (
            "a JSON object without a \"prompt\" string" if isinstance(record, dict)
            else f"JSON {type(record).__name__}, not an object with a \"prompt\" string"))
    return record["prompt"]


def target_name(text):
    """--target: a local model folder or a Hugging Face repo id; what can only be a path must exist."""
    from ..model.pretrained import looks_like_local_path

    if looks_like_local_path(text) and not os.path.isdir(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return text


def drafter_folder(text):
    """A drafter checkpoint folder (reference format: config.json and the weights)."""
    existing_dir(text)
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text} has no config.json: not a drafter checkpoint")
    return text


def drafter_init(text):
    return text if text in ("random", "target") else drafter_folder(text)


def torch_device(text):
    """cpu, cuda or cuda:N, N one of this machine's GPUs. Kept as text: the commands read it so."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def data_records(flag, folder):
    """The records of a gen-data folder, or a usage error naming `flag` when it has none."""
    from ..training.data import load_records

    records = load_records(folder)
    if not records:
        raise UsageError(f"argument {flag}: {folder} has no gen-data records (responses-*.jsonl)")
    return records


def is_nonempty_dir(path) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


def read_target_config(target):
    """The text config of --target (None: the embedded default), read without its weights."""
    from transformers import AutoConfig

    from ..model.config import target_text_config
    from ..model.pretrained import default_target_path

    return target_text_config(AutoConfig.from_pretrained(target or default_target_path()))


def target_layer_count(target) -> int:
    """The decoder layers of --target (None: the embedded default), from its config alone."""
    return read_target_config(target).num_hidden_layers


def drafter_config(flag, folder):
    """The DFlashConfig of the drafter folder `folder` (its config.json alone, no weights read);
    one that would not load is a usage error naming `flag`."""
    from ..model.config import DFlashConfig

    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return DFlashConfig.from_json_dict(json.load(f), source=path)
    except ValueError as e:  # not JSON (json.JSONDecodeError), or a value the config refuses
        raise UsageError(f"argument {flag}: {e}") from None


def check_drafter_fits(drafter, target_config) -> None:
    try:
        drafter.check_fits(target_config)
    except ValueError as e:
        raise UsageError(f"argument --drafter: {e}") from None


def check_layer_ids(layer_ids, num_layers):
    if layer_ids and len(set(layer_ids)) != len(layer_ids):  # a drafter's config refuses it, after all the work
        twice = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
        raise UsageError(f"argument --layer-ids: names target layer{'s' if len(twice) > 1 else ''} "
                         f"{', '.join(map(str, twice))} twice (each layer's features once), got {layer_ids}")
    if layer_ids and max(layer_ids) >= num_layers:
        raise UsageError(f"argument --layer-ids: the target has {num_layers} layers (ids 0..{num_layers - 1}), "
                         f"got {layer_ids}")
