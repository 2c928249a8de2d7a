"""Compare the kernels of two builds by their SASS, names and addresses aside.

    python tools/sass_diff.py OLD.so NEW.so [--map]

Dumps both with cuobjdump, normalises each kernel's SASS (drops the address and encoding comments
and the function's own name), reads the register counts and spill/stack figures, and pairs every
kernel of OLD with a kernel of NEW whose normalised SASS is the same. Prints one line per OLD kernel:
`identical` with its NEW twin (the printed mapping) or `DIFFERENT` with its closest NEW kernel by
name; exits 1 unless every OLD kernel has an identical NEW one with the same registers.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import hashlib
import os
import re
import shutil
import subprocess
import sys


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    here = os.path.dirname(sys.executable)
    for root in (os.path.join(here, ".."), "/usr/local/cuda"):
        for dirpath, _, files in os.walk(root):
            if "cuobjdump" in files:
                return os.path.join(dirpath, "cuobjdump")
    sys.exit("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def dump(path: str, what: str) -> str:
    return subprocess.run([cuobjdump(), what, path], check=True, capture_output=True, text=True).stdout


def normalise(body: str) -> str:
    lines = []
    for line in body.splitlines():
        line = re.sub(r"/\*[^*]*\*/", "", line).strip()
        if not line or line.startswith((".", "-", "=")):
            continue
        lines.append(re.sub(r"\s+", " ", line))
    return "\n".join(lines)


def kernels(path: str) -> dict[str, str]:
    parts = re.split(r"\n\s*Function : (\S+)", dump(path, "--dump-sass"))
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        body = body.split("\n\n\n")[0]
        out[name] = normalise(body.replace(name, "SELF"))
    return out


def resources(path: str) -> dict[str, str]:
    text = dump(path, "--dump-resource-usage")
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"Function (\S+):\n\s*(REG:.*)", text)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    args = parser.parse_args(argv)
    old, new = kernels(args.old), kernels(args.new)
    old_res, new_res = resources(args.old), resources(args.new)
    by_hash = collections.defaultdict(list)
    for name, body in new.items():
        by_hash[hashlib.sha256(body.encode()).hexdigest()].append(name)
    bad = 0
    used = set()
    for name, body in sorted(old.items()):
        twins = [n for n in by_hash.get(hashlib.sha256(body.encode()).hexdigest(), []) if n not in used]
        if twins and new_res.get(twins[0]) == old_res.get(name):
            used.add(twins[0])
            print(f"identical  {old_res.get(name)}  {name}\n           -> {twins[0]}")
            continue
        bad += 1
        close = difflib.get_close_matches(name, list(new), n=1, cutoff=0)
        hint = close[0] if close else "-"
        print(f"DIFFERENT  {old_res.get(name)}  {name}\n           ~> {hint} {new_res.get(hint)}")
    extra = sorted(set(new) - used)
    for name in extra:
        print(f"new only   {new_res.get(name)}  {name}")
    print(f"{len(old) - bad} of {len(old)} kernels identical; {len(extra)} new kernels unpaired")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
