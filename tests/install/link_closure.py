"""Link installed distributions and everything they depend on into one folder.

    python link_closure.py OUT NAME...

Run with the interpreter whose packages are to be shared (.venv's). For each
NAME and, transitively, each requirement whose marker holds (extras
included), every top-level entry the distribution installed (package
folders, modules, its .dist-info) becomes a symlink in OUT. A .pth file naming
OUT then lets another venv import them and lets its pip count them as
installed. pip, setuptools and wheel are left out unless named: a fresh venv
must bring its own packaging tools, as the README says.
"""

import os
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

TOOLS = {"pip", "setuptools", "wheel"}


def closure(roots):
    dists, done = {}, set()
    todo = [(name, ()) for name in roots]
    skip = TOOLS - {canonicalize_name(n) for n in roots}
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in skip or (key, extras) in done:
            continue
        done.add((key, extras))
        dist = dists.setdefault(key, metadata.distribution(name))
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((req.name, tuple(sorted(req.extras))))
    return dists


def main():
    out, roots = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    for key, dist in sorted(closure(roots).items()):
        if dist.files is None:
            sys.exit(f"{key}: no RECORD, cannot tell which files it installed")
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            src, dst = str(dist.locate_file(top)), os.path.join(out, top)
            if os.path.lexists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
        print(f"  linked {dist.metadata['Name']} {dist.version}")


if __name__ == "__main__":
    main()
