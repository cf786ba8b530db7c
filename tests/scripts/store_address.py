"""Rendezvous test helper: where this rank's TCPStore server listens, and gloo's interface.

Prints ``STORE {"rank": r, "port": p, "listen": [addresses listening on p], "gloo_ifname": ...}``;
the listening addresses come from /proc/net/tcp{,6} (rank 0 hosts the server).
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import torch.distributed as dist


def listening_on(port: int) -> list[str]:
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per-word host order
                found.append(str(ipaddress.ip_address(words)))
    return found


store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # PrefixStore -> TCPStore
    store = store.underlying_store
port = int(store.port)
report = {"rank": dist.get_rank(), "port": port, "listen": listening_on(port)}
print("STORE " + json.dumps({**report, "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}), flush=True)
