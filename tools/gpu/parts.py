"""Move a file that is too large for one transfer in numbered parts, checked by SHA-256.

The device tool carries at most 64 MiB a call (the working tree included) and brings back
files of at most 16 MiB from $OUT, so large files travel as parts:

    python3 -m tools.gpu.parts split FILE DIR --part-mib N   # DIR/NAME.part-000 ... + DIR/NAME.sha256
    python3 -m tools.gpu.parts check DIR NAME                # which parts are there and intact
    python3 -m tools.gpu.parts join DIR NAME DEST            # every part checked, joined, the whole checked

NAME.sha256 is a manifest in ``sha256sum`` format (``sha256sum -c --ignore-missing`` reads
it): one line per part, in order, then one for the whole file; a name holding a backslash or
a newline is escaped as sha256sum escapes it (the line starts with a backslash), so any file
name round-trips. Only the standard library: it runs before anything is installed or built.
"""
import argparse
import hashlib
import math
import os
import sys
from typing import List, Tuple

CHUNK = 1 << 20


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def part_name(name: str, i: int) -> str:
    return f"{name}.part-{i:03d}"


def manifest_name(name: str) -> str:
    return f"{name}.sha256"


def _manifest_line(digest: str, name: str) -> str:
    """One sha256sum line: ``HASH  NAME``, escaped as sha256sum escapes a name with a
    backslash or a newline (a leading backslash, then ``\\`` and ``\n`` in the name)."""
    if "\\" in name or "\n" in name:
        return "\\" + f"{digest}  " + name.replace("\\", "\\\\").replace("\n", "\\n") + "\n"
    return f"{digest}  {name}\n"


def _parse_manifest_line(line: str, where: str) -> Tuple[str, str]:
    """(sha256, name) of one manifest line; ValueError naming `where` for anything else."""
    escaped = line.startswith("\\")
    body = line[1:] if escaped else line
    digest, sep, name = body[:64], body[64:66], body[66:]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or sep not in ("  ", " *") or not name:
        raise ValueError(f"{where}: not a sha256sum line (64 hex digits, two spaces, a name): {line!r}")
    if escaped:
        out, i = [], 0
        while i < len(name):
            if name[i] == "\\" and i + 1 < len(name) and name[i + 1] in "\\n":
                out.append("\\" if name[i + 1] == "\\" else "\n")
                i += 2
            else:
                out.append(name[i])
                i += 1
        name = "".join(out)
    return digest, name


def _replace(tmp: str, path: str) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def split(path: str, out_dir: str, part_bytes: int, name: str = None) -> List[str]:
    """Cut `path` into parts of at most `part_bytes` in `out_dir`, with the manifest written
    last: a reader that finds the manifest finds the parts it names. Parts of an earlier
    split of the same name that this one does not write are removed. Returns the part names."""
    if type(part_bytes) is not int or part_bytes < 1:
        raise ValueError(f"part_bytes must be an int >= 1, got {part_bytes!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file" if os.path.exists(path) else f"{path}: no such file")
    name = name or os.path.basename(path)
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"the parts' name must be a file name, got {name!r}")
    os.makedirs(out_dir, exist_ok=True)
    whole = hashlib.sha256()
    lines, names = [], []
    with open(path, "rb") as src:
        while True:
            data = src.read(part_bytes)
            if not data and names:
                break
            whole.update(data)
            part = part_name(name, len(names))
            tmp = os.path.join(out_dir, part + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            _replace(tmp, os.path.join(out_dir, part))
            lines.append(_manifest_line(hashlib.sha256(data).hexdigest(), part))
            names.append(part)
            if len(data) < part_bytes:
                break
    lines.append(_manifest_line(whole.hexdigest(), name))
    tmp = os.path.join(out_dir, manifest_name(name) + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(lines)
    _replace(tmp, os.path.join(out_dir, manifest_name(name)))
    for stale in os.listdir(out_dir):  # a longer earlier split's tail
        if stale.startswith(name + ".part-") and stale not in names:
            os.remove(os.path.join(out_dir, stale))
    return names


def read_manifest(folder: str, name: str) -> Tuple[List[Tuple[str, str]], str]:
    """([(sha256, part name)] in order, sha256 of the whole file)."""
    path = os.path.join(folder, manifest_name(name))
    with open(path, newline="\n") as f:
        lines = [line[:-1] if line.endswith("\n") else line for line in f]
    rows = [_parse_manifest_line(line, f"{path} line {i}") for i, line in enumerate(lines, 1) if line.strip()]
    if len(rows) < 2 or rows[-1][1] != name:
        raise ValueError(f"{path} is not a manifest of {name!r}: one line per part, then one naming the whole file")
    expected = [part_name(name, i) for i in range(len(rows) - 1)]
    if [p for _, p in rows[:-1]] != expected:
        raise ValueError(f"{path}: the parts must be {name!r}.part-000 .. in order, got "
                         f"{[p for _, p in rows[:-1]]!r}")
    return rows[:-1], rows[-1][0]


def check(folder: str, name: str) -> Tuple[List[str], List[str], List[str]]:
    """(intact, missing, corrupt) part names of `name` in `folder`."""
    parts, _ = read_manifest(folder, name)
    intact, missing, corrupt = [], [], []
    for digest, part in parts:
        path = os.path.join(folder, part)
        if not os.path.exists(path):
            missing.append(part)
        elif _sha256(path) != digest:
            corrupt.append(part)
        else:
            intact.append(part)
    return intact, missing, corrupt


def join(folder: str, name: str, dest: str) -> str:
    """Join the parts of `name` into the file `dest` after checking each; the joined file is
    checked against the whole's hash and appears only if it matches. ValueError naming
    each missing or corrupt part otherwise."""
    parts, whole = read_manifest(folder, name)
    _, missing, corrupt = check(folder, name)
    if missing or corrupt:
        raise ValueError(f"{name}: missing parts {missing or 'none'}, corrupt parts {corrupt or 'none'} in {folder}")
    tmp = dest + ".tmp"
    with open(tmp, "wb") as out:
        for _, part in parts:
            with open(os.path.join(folder, part), "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    out.write(block)
    if _sha256(tmp) != whole:  # a part changed between the check and the copy
        os.remove(tmp)
        raise ValueError(f"{name}: the joined file does not match the manifest's hash")
    _replace(tmp, dest)
    return dest


def _part_mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and int(value * (1 << 20)) >= 1):
        raise argparse.ArgumentTypeError(f"must be a number of MiB that is at least one byte, got {text}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu.parts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="cut FILE into parts in DIR")
    s.add_argument("file")
    s.add_argument("dir")
    s.add_argument("--part-mib", type=_part_mib, required=True, help="largest part, in MiB (> 0)")
    s.add_argument("--name", default=None, help="name of the parts (default: the file's name)")
    c = sub.add_parser("check", help="which parts of NAME in DIR are there and intact (exit 1 if not all)")
    c.add_argument("dir")
    c.add_argument("name")
    j = sub.add_parser("join", help="check and join the parts of NAME in DIR into DEST")
    j.add_argument("dir")
    j.add_argument("name")
    j.add_argument("dest")
    args = p.parse_args(argv)
    try:
        if args.command == "split":
            names = split(args.file, args.dir, int(args.part_mib * (1 << 20)), args.name)
            print(f"{args.file}: {len(names)} parts in {args.dir}")
            return 0
        if args.command == "check":
            intact, missing, corrupt = check(args.dir, args.name)
            print(f"{args.name}: {len(intact)} intact of {len(intact) + len(missing) + len(corrupt)} parts"
                  + (f"; missing {' '.join(missing)}" if missing else "")
                  + (f"; CORRUPT {' '.join(corrupt)}" if corrupt else ""))
            return 0 if not (missing or corrupt) else 1
        join(args.dir, args.name, args.dest)
        print(f"{args.name}: joined into {args.dest}, hash checked")
        return 0
    except (OSError, ValueError) as e:
        print(f"parts {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
