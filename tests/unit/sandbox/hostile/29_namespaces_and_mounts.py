"""Create a user namespace (to gain capabilities in it), mount over the runtime, change root, load a module."""
# expect: ok
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
for flags in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWUSER | CLONE_NEWNS):
    if libc.unshare(flags) == 0:
        print("ESCAPED: unshare", hex(flags))
if libc.mount(b"none", b"/usr", b"tmpfs", 0, None) == 0:
    print("ESCAPED: mounted over /usr")
if libc.chroot(b"/scratch") == 0:
    print("ESCAPED: chroot")
try:
    os.setuid(0)
    print("ESCAPED: setuid 0")
except OSError:
    pass
