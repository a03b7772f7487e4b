"""Hold a secret in this sandbox's scratch directory for a while (the victim of 07, run at the same time)."""
# expect: ok
import json, sys, time
ctx = json.loads(sys.stdin.read())
with open("secret.txt", "w") as f:
    f.write(ctx["scratch_secret"])
time.sleep(2)
