"""Launch test helper: every rank all-reduces its rank number and prints the sum."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main() -> None:
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"allreduce sum={value.item():g} world={dist.get_world_size()} args={sys.argv[1:]}")
    sys.stdout.write("partial ")
    sys.stdout.write("line\n")
    print("to stderr", file=sys.stderr)


if __name__ == "__main__":
    main()
