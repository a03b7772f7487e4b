"""Read a secret file the test leaves in the host's /tmp, and search every readable file for its text."""
# expect: ok
import json, os, sys
ctx = json.loads(sys.stdin.read())
try:
    print("ESCAPED:", open(ctx["canary_file"]).read())
except OSError:
    pass
for root, dirs, files in os.walk("/"):
    dirs[:] = [d for d in dirs if not (root == "/" and d in ("proc", "sys", "dev", "usr"))]
    for name in files:
        try:
            if ctx["secret"] in open(os.path.join(root, name), errors="ignore").read():
                print("ESCAPED: secret in", os.path.join(root, name))
        except OSError:
            pass
