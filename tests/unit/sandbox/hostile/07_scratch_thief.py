"""Find another rollout's scratch directory (06, running at the same time) and read its secret."""
# expect: ok
import json, os, sys, time
ctx = json.loads(sys.stdin.read())
time.sleep(0.5)
roots = ["/"] + [f"/proc/{p}/root" for p in filter(str.isdigit, os.listdir("/proc"))]
for top in roots + ["/tmp", "/var/tmp", "/dev/shm", "/run"]:
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "usr", "dev")]
        for name in files:
            try:
                if ctx["scratch_secret"] in open(os.path.join(root, name), errors="ignore").read():
                    print("ESCAPED: found", os.path.join(root, name))
            except OSError:
                pass
