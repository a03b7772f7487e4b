"""Kill the process that runs the tests (the sandbox's harness, PID 1 of the sandbox), so later inputs never run."""
# expect: ok
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
if os.getppid() == 1:
    os.kill(1, signal.SIGKILL)
print("alive")
