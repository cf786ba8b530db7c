"""``python -m varuna.bench memory``: what a rank holds when no rank holds the whole model.

    python -m varuna.bench memory --json             # a ~350M-parameter Llama, limit 2GiB
    python -m varuna.bench memory --quick --limit 1GiB

One Llama-style `transformers.LlamaConfig` model (untied embeddings: torch.pipelining cannot share
a weight between stages, so both systems train the same model), sequence 16, micro-batch 1, SGD
without momentum, fp32. Before any job the bench writes a Hugging Face sharded safetensors folder
of it (shards of at most `shard_bytes`, and `model.safetensors.index.json`) without ever holding
the model: it walks the meta model's state-dict shapes and makes one shard's tensors at a time
(normal x 0.02, ones for the norms). Then, each in its own `varuna run` job:

    varuna            at each P of `pipelines` (D = 1): the model built on the meta device,
                      `Varuna(..., weights=FOLDER)`, `steps` steps. Each rank reports its resident
                      memory before the model (baseline), its peak once the engine is built (its
                      stage real and loaded) and after the steps (VmHWM, reset at the baseline), the
                      growths over the baseline, its stage's parameter bytes and the engine's
                      pre-flight estimate (`engine.memory_estimate`) with two errors:
                      `estimate_error_pct`, the estimate's total against the growth, and
                      `check_error_pct`, what the check compares (the estimate's baseline, the
                      resident memory at the check, plus its total) against the peak.
    torch.pipelining  at each P of `torch_pipelines`: its own meta-device recipe on the same model
                      and folder, at the layers Varuna's partition gave each stage at that P, with
                      the same measurements (`varuna.bench.memory.worker`).

Then the largest model that fits a per-rank limit (`limit`): with the hidden size fixed, for each
P the most layers whose estimate fits, found in this one process without training (`LayerSearch`):
for n layers the model is built on meta and traced, and priced at P as the engine prices a rank
(`varuna.engine.preflight.rank_estimate`, with the partition the engine chooses for a meta model:
balanced by parameter count). n fits when the largest rank's estimate plus the baseline fits the
limit; the baseline is the largest resident memory at the check that the engine saw on any rank of
the `varuna` job at that P (`memory_estimate.baseline`), plus `baseline_margin` of the limit. Each
size found at a P of `verify_pipelines` is then run for real: `steps` steps under `memory_limit=`
the limit (seeded init, no weights file). It must not be refused and must finish; the report says
whether each rank's estimate equals the search's, and whether its measured peak stayed under the
limit (the check is an estimate: it can pass a shape whose peak ends a little over).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varuna.bench import ROOT, bench_env, log, print_report, require_positive
from varuna.bench.common import stop_job
from varuna.errors import ConfigError, LaunchError

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

_WORKER = "varuna.bench.memory.worker"


@dataclass(kw_only=True, slots=True)
class MemoryBench:
    """What the memory benchmark measures; see `full` and `quick` for the presets."""

    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `transformers.LlamaConfig` (num_hidden_layers included)."""
    seq_len: int = 16
    micro_batch_size: int = 1
    global_batch_size: int = 4
    """Samples per step: global_batch_size / micro_batch_size micro-batches through the one pipeline."""
    steps: int = 2
    pipelines: tuple[int, ...] = (1, 2, 4)
    """P of the Varuna jobs (D = 1); the search prices the same P."""
    torch_pipelines: tuple[int, ...] = (2, 4)
    """P of the torch.distributed.pipelining jobs; each must be among `pipelines` (its stages hold
    the layers Varuna's partition gave them there)."""
    verify_pipelines: tuple[int, ...] = (1, 2, 4)
    """P at which the largest fitting size is run for real under `memory_limit=`."""
    limit: str = "2GiB"
    """The per-rank limit of the search and of the verifying runs (a size as `memory_limit=` takes)."""
    baseline_margin: float = 0.01
    """Part of the limit the search keeps free beyond the baseline it measured at the bench's size:
    a larger meta model (its modules, its trace) adds to the resident memory at the engine's check."""
    shard_bytes: int = 200 * 10**6
    """The most bytes of tensors in one safetensors shard."""
    lr: float = 1e-3
    job_timeout_s: float = 300.0
    """A job that runs longer fails, naming its system and P."""

    def __post_init__(self) -> None:
        require_positive(self, "seq_len", "micro_batch_size", "global_batch_size", "steps", "shard_bytes")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"MemoryBench.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        layers = self.config.get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 1:
            raise ConfigError(f"MemoryBench.config needs num_hidden_layers >= 1 (got {layers!r})")
        for p in self.pipelines:
            if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= layers:
                raise ConfigError(
                    f"MemoryBench.pipelines must be integers in [1, num_hidden_layers={layers}] (got {p!r})"
                )
        for name in ("torch_pipelines", "verify_pipelines"):
            outside = [p for p in getattr(self, name) if p not in self.pipelines]
            if outside:
                raise ConfigError(
                    f"MemoryBench.{name} {list(getattr(self, name))} holds {outside}, not among "
                    f"pipelines {list(self.pipelines)}: add them there (the Varuna job at that P comes first)"
                )
        if not 0 <= self.baseline_margin < 1:
            raise ConfigError(f"MemoryBench.baseline_margin must be in [0, 1) (got {self.baseline_margin!r})")
        if 1 in self.torch_pipelines:
            raise ConfigError(
                "MemoryBench.torch_pipelines must be >= 2 (a pipeline of one stage is no pipeline)"
            )
        from varuna.planner.memory import parse_memory

        parse_memory(self.limit)

    def spec(self, **extra: Any) -> dict[str, Any]:
        """What a worker reads (`varuna.bench.memory.worker`)."""
        return {
            "config": self.config,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "steps": self.steps,
            "lr": self.lr,
            "memory_limit": None,
            "weights": None,
        } | extra


_LLAMA = {
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def full() -> MemoryBench:
    """A ~350M-parameter Llama (hidden 1024, 24 layers, 16 heads, 8 key-value heads, vocab 32000),
    P = 1, 2, 4, limit 2GiB."""
    config = _LLAMA | {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 16,
    }
    return MemoryBench(config=config)


def quick() -> MemoryBench:
    """A ~38M-parameter Llama (hidden 768, 4 layers, vocab 8000), limit 1GiB; torch.pipelining and
    the verifying run at P = 2 only (a 4-rank job costs the most start-up on 2 cores)."""
    config = _LLAMA | {
        "vocab_size": 8000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "max_position_embeddings": 16,
    }
    return MemoryBench(
        config=config, limit="1GiB", torch_pipelines=(2,), verify_pipelines=(2,), job_timeout_s=120.0
    )


# ------------------------------------------------------------------------------------ weights


def meta_llama(config: dict[str, Any]) -> Any:
    """`transformers.LlamaForCausalLM(LlamaConfig(**config))` on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def write_weights(model: Any, folder: Path, *, shard_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Write `model`'s state dict (its shapes: `model` may be on meta) as a Hugging Face sharded
    safetensors folder, making one tensor at a time: normal x 0.02, ones for the norms. At most
    one shard's tensors are held at once. Returns the shard count, the bytes and the seconds."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    shapes = [(k, tuple(t.shape), t.dtype) for k, t in model.state_dict().items()]
    shards: list[list[tuple[str, tuple[int, ...], Any]]] = [[]]
    size = total = 0
    for key, shape, dtype in shapes:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape, dtype))
        size += nbytes
        total += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape, dtype in shard:
            if key.endswith("norm.weight"):
                tensors[key] = torch.ones(shape, dtype=dtype)
            else:
                tensors[key] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
            weight_map[key] = name
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return {"shards": len(shards), "bytes": total, "write_s": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------------------- jobs


def _job(bench: MemoryBench, tmp: Path, tag: str, pipeline: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One `varuna run` job of the worker; its exit status, the ranks' records (sorted by rank) and,
    when it failed, the end of its log."""
    out = tmp / tag
    out.mkdir()
    spec_path = tmp / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec | {"pipeline": pipeline, "out": str(out)}, indent=1))
    cmd = [sys.executable, "-m", "varuna", "run", "--pipeline", str(pipeline), "--data", "1"]
    cmd += ["--run-dir", str(tmp / f"run-{tag}"), "--timeout", f"{bench.job_timeout_s:g}"]
    cmd += ["-m", _WORKER, str(spec_path)]
    log_path = tmp / f"{tag}.log"
    t0 = time.perf_counter()
    env = bench_env(120) | {"TRANSFORMERS_VERBOSITY": "error"}
    with open(log_path, "wb") as sink:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | str = proc.wait(timeout=bench.job_timeout_s + 30)
        except subprocess.TimeoutExpired:
            stop_job(proc)
            code = f"timeout after {bench.job_timeout_s:g} s"
        except BaseException:  # the bench itself stopped (SIGTERM, Ctrl-C): so does its job
            stop_job(proc)
            raise
    records = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    records.sort(key=lambda r: r["rank"])
    wall = round(time.perf_counter() - t0, 1)
    log(f"{tag}: exit {code} in {wall} s")
    tail = ""
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    return {"code": code, "ranks": records, "wall_s": wall, "log_tail": tail}


def _ok(job: dict[str, Any], pipeline: int, what: str) -> list[dict[str, Any]]:
    if job["code"] != 0 or len(job["ranks"]) != pipeline:
        raise LaunchError(
            f"the {what} job at P={pipeline} failed ({job['code']}, {len(job['ranks'])} of {pipeline} "
            f"ranks reported); the end of its log:\n{job['log_tail']}"
        )
    return list(job["ranks"])


def _pct(estimate: float, measured: float) -> float | None:
    return round(100 * (estimate - measured) / measured, 1) if measured > 0 else None


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """A rank's record with its growth (over the whole run, and up to the stage made real and
    loaded: `built_growth_bytes`) and, where the engine estimated, the estimate's errors:
    `estimate_error_pct` of the estimate's total against the growth (peak - baseline) and
    `check_error_pct` of what the check compares (the estimate's baseline + total) against the peak."""
    row = dict(r)
    if "peak_bytes" in r and "baseline_bytes" in r:
        row["growth_bytes"] = r["peak_bytes"] - r["baseline_bytes"]
    if "built_peak_bytes" in r:
        row["built_growth_bytes"] = r["built_peak_bytes"] - r["baseline_bytes"]
    est = r.get("estimate")
    if est is not None and "growth_bytes" in row:
        row["estimate_error_pct"] = _pct(est["total"], row["growth_bytes"])
        row["check_error_pct"] = _pct(est["baseline"] + est["total"], r["peak_bytes"])
    return row


# ------------------------------------------------------------------------------------- search


class LayerSearch:
    """The engine's pre-flight estimate of a Llama of n layers (hidden size fixed) at each P,
    without training: the model built on meta and traced once per n, then priced at each P by
    `varuna.engine.preflight.rank_estimate` with the partition, schedule and options the engine
    uses for a meta model there. One call prices every stage (its `stage_bytes`: parameters,
    gradients, optimizer state and activations per stage, by `stage_memory`); a rank's total adds
    what `rank_estimate` adds for it, the largest gradient of its stage once more and the working
    memory (a rank's own call would repeat the meta forward once per rank). The verifying runs
    compare these totals with the engines' own."""

    def __init__(self, bench: MemoryBench) -> None:
        import torch

        from varuna.engine.config import VarunaConfig

        self.bench = bench
        self.configs = {
            P: VarunaConfig(
                pipeline=P,
                data=1,
                global_batch_size=bench.global_batch_size,
                micro_batch_size=bench.micro_batch_size,
                schedule="1f1b",
                optimizer_state="none",
                memory_limit=bench.limit,
            )
            for P in bench.pipelines
        }
        g = torch.Generator().manual_seed(1)
        vocab = bench.config["vocab_size"]
        ids = torch.randint(3, vocab, (bench.micro_batch_size, bench.seq_len), generator=g)
        self.micro = {"input_ids": ids, "labels": ids}
        self._traced: dict[int, tuple[Any, Any]] = {}
        self._priced: dict[tuple[int, int], list[int]] = {}

    def _model(self, layers: int) -> tuple[Any, Any]:
        from varuna import auto_cut
        from varuna.cut.partition import trace_model

        if layers not in self._traced:
            self._traced.clear()  # one meta model at a time: the search walks n up or down
            model = meta_llama(self.bench.config | {"num_hidden_layers": layers})
            auto_cut(model)
            self._traced[layers] = (model, trace_model(model, self.micro))
        return self._traced[layers]

    def rank_totals(self, layers: int, pipeline: int) -> list[int]:
        """`memory_estimate.total` of each rank of a P = `pipeline`, D = 1 engine on n `layers`."""
        import torch

        from varuna.cut.partition import make_partition
        from varuna.engine.preflight import rank_estimate
        from varuna.schedule import build_schedule, schedule_spec

        if (layers, pipeline) in self._priced:
            return self._priced[layers, pipeline]
        model, trace = self._model(layers)
        config = self.configs[pipeline]
        e = config.engine
        spec = schedule_spec(e.schedule)
        partition = make_partition(trace, pipeline * spec.chunks_per_rank)  # meta: by parameter count
        schedule = build_schedule(
            e.schedule, pipeline, e.num_microbatches, recompute=e.recompute, split_backward=e.split_backward
        )
        every = rank_estimate(
            model,
            self.micro,
            trace,
            partition,
            config,
            schedule,
            chunk_stages=list(range(partition.num_stages)),
            rank_of=lambda v: spec.rank_of(v, pipeline),
            device=torch.device("cpu"),
        )
        trainable = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
        totals = []
        for rank in range(pipeline):
            stages = spec.stages_of(rank, pipeline)
            held = {n for v in stages for n in partition.stage_params[v]}
            transient = max((trainable[n] for n in held if n in trainable), default=0)
            totals.append(sum(every.stage_bytes[v] for v in stages) + transient + every.working)
        self._priced[layers, pipeline] = totals
        return totals

    def largest(self, pipeline: int, baseline: int, limit: int, start: int) -> dict[str, Any]:
        """The most layers whose largest rank's estimate plus `baseline` fits `limit` at `pipeline`:
        a straight-line guess from `start` layers and `pipeline` more (about one more per stage),
        then a layer at a time to the edge."""

        from varuna.engine.preflight import required

        def need(n: int) -> int:  # what the engine's check asks for the largest rank
            return required(max(self.rank_totals(n, pipeline)), baseline)

        before = len(self._priced)
        least = max(pipeline, 2)  # auto_cut needs two blocks; each stage one
        lo = max(start, least)
        if need(least) > limit:
            return {"layers": 0, "rank_bytes": None, "evaluations": len(self._priced) - before}
        slope = max((need(lo + pipeline) - need(lo)) / pipeline, 1.0)
        n = max(least, lo + int((limit - need(lo)) / slope))
        while n > least and need(n) > limit:
            n -= 1
        while need(n + 1) <= limit:
            n += 1
        return {
            "layers": n,
            "rank_bytes": self.rank_totals(n, pipeline),
            "next_layer_needs_bytes": need(n + 1),
            "evaluations": len(self._priced) - before,
        }


def _count_params(config: dict[str, Any]) -> int:
    return sum(p.numel() for p in meta_llama(config).parameters())


# ---------------------------------------------------------------------------------------- run


def _largest_models(bench: MemoryBench, tmp: Path, varuna_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The most layers that fit `bench.limit` at each P (`LayerSearch`, with the baselines the
    `varuna` jobs saw), each at a P of `verify_pipelines` run for real under `memory_limit=`."""
    from varuna.engine.preflight import resident_bytes
    from varuna.planner.memory import parse_memory

    limit = parse_memory(bench.limit)
    log(f"largest model under {bench.limit} per rank: estimates of n layers at P = {list(bench.pipelines)}")
    search = LayerSearch(bench)
    t_search = time.perf_counter()
    found: list[dict[str, Any]] = []
    margin = int(limit * bench.baseline_margin)
    for run_ in varuna_runs:
        P = run_["pipeline"]
        baseline = max(r["estimate"]["baseline"] for r in run_["ranks"])
        best = search.largest(P, baseline + margin, limit, bench.config["num_hidden_layers"])
        n = best["layers"]
        params_n = _count_params(bench.config | {"num_hidden_layers": n}) if n else 0
        found.append(
            {"pipeline": P, "baseline_bytes": baseline, "margin_bytes": margin, "params": params_n} | best
        )
        log(f"P={P}: {n} layers ({params_n / 1e6:.0f}M parameters) fit, {best['evaluations']} estimates")
    search_s = round(time.perf_counter() - t_search, 1)

    for row in found:
        P, n = row["pipeline"], row["layers"]
        if P not in bench.verify_pipelines or n == 0:
            row["verified"] = None
            continue
        log(f"verify P={P}: {n} layers, {bench.steps} steps under memory_limit={bench.limit!r}")
        config = bench.config | {"num_hidden_layers": n}
        spec = bench.spec(system="varuna", memory_limit=bench.limit) | {"config": config}
        job = _job(bench, tmp, f"verify-p{P}", P, spec)
        ranks = [_rank_row(r) for r in job["ranks"]]
        refused = [r["refused"] for r in ranks if r.get("refused")]
        finished = job["code"] == 0 and len(ranks) == P and not refused
        verified: dict[str, Any] = {
            "finished": finished,
            "refused": refused[0] if refused else None,
            "wall_s": job["wall_s"],
            "ranks": ranks,
        }
        if finished:
            verified["engine_matches_search"] = [r["estimate"]["total"] for r in ranks] == row["rank_bytes"]
            verified["peak_within_limit"] = all(r["peak_bytes"] <= limit for r in ranks)
            verified["check_within_limit"] = all(
                r["estimate"]["baseline"] + r["estimate"]["total"] <= limit for r in ranks
            )
        else:
            verified["log_tail"] = job["log_tail"]
        row["verified"] = verified
    return {
        "limit": bench.limit,
        "limit_bytes": limit,
        "hidden_size": bench.config["hidden_size"],
        "search_s": search_s,
        "search_process_rss_bytes": resident_bytes(),
        "per_pipeline": found,
    }


def run(bench: MemoryBench, *, keep: bool = False) -> dict[str, Any]:
    """Run every job of `bench` (one at a time) and the search; return the report. The temporary
    folder (weights, specs, logs) goes at the end, failed or not, unless `keep`: a failed job's
    error carries the end of its log."""
    tmp = Path(tempfile.mkdtemp(prefix="varuna-bench-memory-"))
    try:
        return _run(bench, tmp)
    finally:
        if keep:
            log(f"kept {tmp} (weights, specs, logs)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(bench: MemoryBench, tmp: Path) -> dict[str, Any]:
    import torch
    import transformers

    from varuna.planner.memory import format_bytes

    t0 = time.perf_counter()
    model = meta_llama(bench.config)
    params = sum(p.numel() for p in model.parameters())
    weights = tmp / "weights"
    log(f"writing {params / 1e6:.1f}M parameters as sharded safetensors to {weights}")
    written = write_weights(model, weights, shard_bytes=bench.shard_bytes)
    del model
    log(f"{written['shards']} shards, {format_bytes(written['bytes'])} in {written['write_s']} s")

    varuna_runs: list[dict[str, Any]] = []
    for P in bench.pipelines:
        log(f"varuna P={P}: {bench.steps} steps, weights from the folder")
        job = _job(bench, tmp, f"varuna-p{P}", P, bench.spec(system="varuna", weights=str(weights)))
        ranks = [_rank_row(r) for r in _ok(job, P, "varuna")]
        varuna_runs.append({"pipeline": P, "wall_s": job["wall_s"], "ranks": ranks})

    torch_runs: list[dict[str, Any]] = []
    for P in bench.torch_pipelines:
        layers = [r["layers"] for r in next(v for v in varuna_runs if v["pipeline"] == P)["ranks"]]
        log(f"torch.pipelining P={P}: {bench.steps} steps, layers per stage as Varuna's")
        spec = bench.spec(system="torch", weights=str(weights), stage_layers=layers)
        job = _job(bench, tmp, f"torch-p{P}", P, spec)
        if job["code"] != 0 or len(job["ranks"]) != P:
            torch_runs.append(
                {"pipeline": P, "not_measured": f"the job failed ({job['code']}): {job['log_tail'][-2000:]}"}
            )
            continue
        torch_runs.append(
            {"pipeline": P, "wall_s": job["wall_s"], "ranks": [_rank_row(r) for r in job["ranks"]]}
        )

    largest = _largest_models(bench, tmp, varuna_runs)
    return {
        "bench": "memory",
        "config": asdict(bench),
        "model": {
            "config": bench.config,
            "params": params,
            "param_bytes": params * 4,
            "dtype": "float32",
            "optimizer": "SGD (no momentum: optimizer_state='none')",
            "weights": written,
        },
        "varuna": varuna_runs,
        "torch_pipelining": torch_runs,
        "largest_model": largest,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "wall_s": round(time.perf_counter() - t0, 1),
    }


# -------------------------------------------------------------------------------------- table


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def format_table(report: dict[str, Any]) -> str:
    """The report for people: one line per rank (MiB), then the largest model per P."""
    m = report["model"]
    lines = [
        f"Llama {m['params'] / 1e6:.1f}M parameters ({_mib(m['param_bytes'])} MiB fp32), "
        f"{m['weights']['shards']} shards; resident memory per rank in MiB, growth over the baseline:",
        "system            P  rank  layers  stage params  baseline  built  peak  growth  estimate  error",
    ]
    runs = [("varuna", r) for r in report["varuna"]]
    runs += [("torch.pipelining", r) for r in report["torch_pipelining"]]
    for system, run_ in runs:
        if "not_measured" in run_:
            lines.append(f"{system:<17} {run_['pipeline']}  not measured: {run_['not_measured'][:200]}")
            continue
        for r in run_["ranks"]:
            est = r.get("estimate")
            span = f"{r['layers'][0]}-{r['layers'][-1]}" if r["layers"] else "-"
            error = r.get("estimate_error_pct")
            cells = [
                f"{system:<17} {run_['pipeline']}",
                f"{r['rank']:>4}",
                f"{span:>6}",
                f"{_mib(r['stage_param_bytes']):>12}",
                f"{_mib(r['baseline_bytes']):>8}",
                f"{_mib(r['built_growth_bytes']):>5}",
                f"{_mib(r['peak_bytes']):>4}",
                f"{_mib(r['growth_bytes']):>6}",
                f"{_mib(est['total'] if est else None):>8}",
                f"{error:+.0f}%" if error is not None else "-",
            ]
            lines.append("  ".join(cells))
    big = report["largest_model"]
    lines.append(f"largest model under {big['limit']} per rank (hidden {big['hidden_size']}):")
    for row in big["per_pipeline"]:
        v = row["verified"]
        if v is None:
            state = "not run"
        elif v["finished"]:
            peak = max(r["peak_bytes"] for r in v["ranks"])
            state = f"finished, peak {_mib(peak)} MiB"
        else:
            state = f"FAILED: {v['refused'] or 'see log_tail'}"
        lines.append(
            f"  P={row['pipeline']}: {row['layers']} layers, {row['params'] / 1e6:.0f}M parameters; "
            f"verified: {state}"
        )
    lines.append(f"wall {report['wall_s']} s")
    return "\n".join(lines)


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench memory`; `args` has `json`, `quick`, `limit` and `keep`."""
    bench = quick() if args.quick else full()
    if getattr(args, "limit", None):
        bench = MemoryBench(**(asdict(bench) | {"limit": args.limit}))
    report = run(bench, keep=bool(getattr(args, "keep", False)))
    return print_report(report, format_table(report), args.json)
