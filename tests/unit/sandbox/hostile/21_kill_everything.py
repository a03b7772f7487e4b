"""Send SIGKILL to every PID up to 65536 and to every process it may signal (kill -1)."""
# expect: ok
import os, signal
for pid in range(2, 1 << 16):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
for target in (1, -1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:  # kill -1 finds no other process
        pass
print("alive")
