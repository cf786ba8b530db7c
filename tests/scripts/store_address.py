"""Rendezvous test helper: where this rank's TCPStore server listens, and gloo's interface.

Prints ``STORE {"rank": r, "port": p, "listen": [addresses listening on p], "gloo_ifname": ...}``;
the listening addresses come from /proc/net/tcp{,6} (rank 0 hosts the server).
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from varuna.comm.addresses import listening_on  # noqa: E402

store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # PrefixStore -> TCPStore
    store = store.underlying_store
port = int(store.port)
report = {"rank": dist.get_rank(), "port": port, "listen": listening_on(port)}
print("STORE " + json.dumps({**report, "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}), flush=True)
