"""``python -m varuna.bench memory``: what a rank holds when no rank holds the whole model.

    driver   the settings (`MemoryBench`, `full`, `quick`), the weights folder (`write_weights`),
             one `varuna run` job per system and P, the largest-model search (`LayerSearch`), the report
    worker   what every rank of a job runs: a Llama built on meta, its stage made real, memory measured

The method is the driver's docstring.
"""

from __future__ import annotations

from varuna.bench.memory.driver import (
    LayerSearch,
    MemoryBench,
    format_table,
    full,
    main,
    meta_llama,
    quick,
    run,
    write_weights,
)

__all__ = [
    "MemoryBench",
    "full",
    "quick",
    "run",
    "meta_llama",
    "write_weights",
    "LayerSearch",
    "format_table",
    "main",
]
