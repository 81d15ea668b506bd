"""Write every frame seen on an interface to a file until terminated (the lab has no tcpdump; run as root in a
namespace). usage: capture.py IFACE OUTFILE"""

from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main() -> None:
    iface, out = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((iface, 0))
    s.settimeout(0.2)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    with open(out, "wb") as f:
        while not stop:
            try:
                f.write(s.recv(65535))
            except TimeoutError:
                continue
            f.flush()


if __name__ == "__main__":
    main()
