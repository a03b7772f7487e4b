"""Open a TCP connection to a socket the test listens on at 127.0.0.1, and to an outside address."""
# expect: ok
import json, socket, sys
ctx = json.loads(sys.stdin.read())
for address in (("127.0.0.1", ctx["port"]), ("10.0.0.1", 80), ("1.1.1.1", 53)):
    try:
        socket.create_connection(address, timeout=1).sendall(b"escaped")
        print("ESCAPED: connected to", address)
    except OSError:
        pass
