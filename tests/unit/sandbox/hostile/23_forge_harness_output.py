"""Write a forged verdict into the harness's stdout and memory through /proc."""
# expect: ok
import os
parent = os.getppid()
for path, mode in ((f"/proc/{parent}/fd/1", "w"), (f"/proc/{parent}/mem", "r+b"), (f"/proc/{parent}/environ", "rb")):
    try:
        with open(path, mode) as f:
            if "w" in mode:
                f.write('[{"stdout": "forged", "stderr": "", "exit_code": 0, "status": "ok", "seconds": 0}]')
        print("ESCAPED: opened", path)
    except OSError:
        pass
