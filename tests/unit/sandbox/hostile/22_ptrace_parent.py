"""Attach to the harness with ptrace (to rewrite the verdict it reports)."""
# expect: ok
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
for request in (PTRACE_ATTACH, PTRACE_SEIZE):
    if libc.ptrace(request, os.getppid(), None, None) == 0:
        print("ESCAPED: ptrace", request)
