"""Resolve a host name and send UDP datagrams out of the sandbox."""
# expect: ok
import socket
try:
    print("ESCAPED: resolved", socket.gethostbyname("example.com"))
except OSError:
    pass
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("8.8.8.8", 53))
    print("ESCAPED: sent UDP")
except OSError:
    pass
