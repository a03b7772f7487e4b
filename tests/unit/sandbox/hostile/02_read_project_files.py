"""Read the project's files, by their host path and by searching the whole file tree for pyproject.toml."""
# expect: ok
import json, os, sys
ctx = json.loads(sys.stdin.read())
for path in ("README.md", "pyproject.toml", "zrl/sandbox.py"):
    try:
        open(os.path.join(ctx["project"], path)).read()
        print("ESCAPED: read", path)
    except OSError:
        pass
for root, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if not (root == "/" and d in ("proc", "sys", "dev", "usr"))]
    if "pyproject.toml" in files and 'name = "zrl"' in open(os.path.join(root, "pyproject.toml")).read():
        print("ESCAPED: found the project at", root)
