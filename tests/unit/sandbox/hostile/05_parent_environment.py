"""Read the parent's environment variables: our own, and every /proc/<pid>/environ visible."""
# expect: ok
import json, os, sys
ctx = json.loads(sys.stdin.read())
seen = [repr(dict(os.environ))]
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        seen.append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="ignore"))
    except OSError:
        pass
if any(ctx["secret"] in text or ctx["secret_name"] in text for text in seen):
    print("ESCAPED: parent environment")
print(sorted(os.environ))
