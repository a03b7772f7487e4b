"""Write outside the scratch directory: the sandbox root, the runtime, the host's /tmp and the project."""
# expect: ok
import json, os, sys
ctx = json.loads(sys.stdin.read())
for path in ("/escaped", "/usr/escaped", "/tmp/escaped", ctx["host_write"], os.path.join(ctx["project"], "ESCAPED")):
    try:
        with open(path, "w") as f:
            f.write("x")
        print("ESCAPED: wrote", path)
    except OSError:
        pass
