"""Look at other processes through /proc: only the harness (PID 1) and the program itself may be there."""
# expect: ok
import os
mine = {"1", str(os.getpid()), "self", "thread-self"}
for entry in os.listdir("/proc"):
    if entry.isdigit() and entry not in mine:
        print("ESCAPED: sees process", entry, open(f"/proc/{entry}/cmdline", "rb").read()[:60])
