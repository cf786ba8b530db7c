"""Generate docs/configuration.md: every `Varuna(...)` option and every `VARUNA_*` environment variable.

    python docs/gen_config.py > docs/configuration.md

The options come from the code: `varuna.engine.config.OPTIONS` maps each option to the component
that owns it, and each component's dataclass gives the field's type, default and docstring (read with
`ast`, since a dataclass field's docstring is not kept at run time). The environment variables are
the `"VARUNA_..."` string constants in the package's source; which modules read and which set each
one is found in the syntax tree, and its meaning is the one-line entry in `ENV_MEANINGS` below. A
variable or a `Varuna(...)` argument that has no entry stops the generator, naming it, and
tests/unit/test_docs.py fails while docs/configuration.md differs from this script's output.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "varuna", ROOT / "widgets" / "varuna_widgets")
ENV_NAME = re.compile(r"^VARUNA_[A-Z0-9_]*[A-Z0-9]$")

# Who sets each variable ("you" or the launcher for its ranks), and what it means, in one line.
ENV_MEANINGS: dict[str, tuple[str, str]] = {
    "VARUNA_BACKEND": (
        "you",
        "`gloo` or `nccl`: the torch.distributed backend (default: NCCL when CUDA is available, else gloo).",
    ),
    "VARUNA_COMMANDS": (
        "launcher",
        "The controller's ZeroMQ address the ranks take commands from (checkpoint, stop, set).",
    ),
    "VARUNA_DATA": (
        "launcher",
        "D, the data-parallel degree of `varuna run --data`; `Varuna(data=None)` takes it.",
    ),
    "VARUNA_EVENTS": (
        "launcher",
        "The controller's ZeroMQ address the ranks send their telemetry events to.",
    ),
    "VARUNA_EVENTS_KEY": (
        "launcher",
        "The job's HMAC key (hex) that signs events and commands; passed by name in the environment, never on a command line.",
    ),
    "VARUNA_HEARTBEAT_S": ("you", "Seconds between a rank's heartbeats (default 1; `0` turns them off)."),
    "VARUNA_JOB_ID": (
        "launcher",
        "This launch's id: tags status and rendezvous files, and finds the job's processes in /proc.",
    ),
    "VARUNA_LAUNCH": (
        "launcher",
        "Which launch of the job this is (1, then 2, ... after relaunches); stamped on events.",
    ),
    "VARUNA_LAUNCHED": ("launcher", "`1` in a process that `varuna.launch.worker` started."),
    "VARUNA_LAUNCHER": (
        "you",
        "`mpiexec` keeps mpiexec inside a Slurm allocation, `srun` insists on srun (the launcher sets `srun` for its ranks under Slurm).",
    ),
    "VARUNA_LOG_LEVEL": (
        "you",
        "Level of the `varuna` logger (DEBUG, INFO, WARNING, ...); default INFO on rank 0, WARNING on the others.",
    ),
    "VARUNA_MASTER_ADDR": (
        "you",
        "The address rank 0's store and a multi-host controller advertise, instead of the one that routes to the other hosts.",
    ),
    "VARUNA_MPIEXEC": (
        "you",
        "The mpiexec to run (default: the one beside this Python, from the MPI wheel, else the one on PATH).",
    ),
    "VARUNA_MPIEXEC_ARGS": (
        "you",
        "Options for mpiexec itself, shell-quoted, placed before varuna's (`-launcher ssh`, `-iface ib0`).",
    ),
    "VARUNA_NCCL_RULES": (
        "you",
        "`1`: point-to-point on gloo follows NCCL's ordering and creation rules; `strict`: one order across communicators too.",
    ),
    "VARUNA_P2P": (
        "you",
        "`serial`: serial links on gloo too; `early`: early receives everywhere (default: serial on NCCL and under strict rules).",
    ),
    "VARUNA_P2P_HEADERS": (
        "you",
        "`every`: a shape header with every activation (default `step`: shapes once per step).",
    ),
    "VARUNA_P2P_WATCH": (
        "you",
        "`1`: a watcher thread per neighbour reports arrivals on gloo (off by default).",
    ),
    "VARUNA_NOTICE_S": (
        "you",
        "The preemption notice window when `Varuna(notice_s=None)`: a SIGTERM means the host goes away this long after (90, 90s, 2min).",
    ),
    "VARUNA_PIPELINE": (
        "launcher",
        "P, the pipeline depth of `varuna run --pipeline`; `Varuna(pipeline=None)` takes it.",
    ),
    "VARUNA_PROFILE": (
        "launcher",
        "`1` while `varuna profile` runs your script, which may test it to skip set-up the profile does not need.",
    ),
    "VARUNA_PROFILE_MBS": ("launcher", "The micro-batch sizes `varuna profile` measures (`1,2,4`)."),
    "VARUNA_PROFILE_REPEATS": ("launcher", "Measured repetitions of each segment in `varuna profile` (3)."),
    "VARUNA_RENDEZVOUS_TIMEOUT_S": (
        "you",
        "Seconds a rank waits for the others to meet before failing the job (300).",
    ),
    "VARUNA_RESUME": (
        "launcher",
        "What `Varuna(resume=None)` resumes from: `latest` or a checkpoint directory; relaunches set `latest`.",
    ),
    "VARUNA_RUN_DIR": (
        "launcher",
        "The job's run directory (logs, status, checkpoints); `Varuna(run_dir=None)` takes it.",
    ),
    "VARUNA_SRUN": ("you", "The srun binary to run (default: srun on PATH)."),
    "VARUNA_SRUN_ARGS": ("you", "srun options of your cluster, shell-quoted (`--gpus-per-task=1`)."),
    "VARUNA_STRAGGLER": ("you", "`0` turns straggler detection off."),
    "VARUNA_STRAGGLER_RATIO": (
        "you",
        "How many times its peers' compute time a rank must take to count as slow (1.3).",
    ),
    "VARUNA_STRAGGLER_SKIP_STEPS": ("you", "First steps of a launch that are not judged (1)."),
    "VARUNA_STRAGGLER_STEPS": ("you", "Consecutive slow steps before a rank is flagged (3, at most 5)."),
    "VARUNA_TELEMETRY": ("you", "`0` turns the ranks' telemetry off."),
    "VARUNA_TELEMETRY_MEMORY_EVERY": (
        "you",
        "Count the activations saved for backward on every N-th recorded step (20).",
    ),
    "VARUNA_TELEMETRY_MIN_INTERVAL_S": (
        "you",
        "At most one spans event per this many seconds (0: no limit).",
    ),
    "VARUNA_TELEMETRY_SPANS_EVERY": ("you", "Record the spans of every N-th step (1)."),
    "VARUNA_THREADS": ("you", "torch threads per rank (1)."),
    "VARUNA_TIMEOUT": (
        "you",
        "Seconds before a distributed operation times out (120); also the job's process groups' timeout.",
    ),
}

# The arguments of Varuna(...) that are not options of a component's config.
ARGUMENTS: dict[str, str] = {
    "model": "The `nn.Module` to train, annotated with CutPoints or cut by `auto_cut`; it returns its loss (or an output with `.loss`).",
    "example_batch": 'One batch dict (e.g. `collate(dataset[:2])`): traced once to find the CutPoints\' order and the shapes crossing them; needed when `pipeline > 1` or `"auto"`.',
    "init": "How a model built on the meta device without `weights=` is initialised: `fn(qualified_name, module)`; default: each module's own init (`varuna.init_weights`).",
    "plan_info": 'Internal: the plan `pipeline="auto"` chose, passed from `varuna.Varuna` to the engine (recorded in `engine.json`).',
}

COMPONENT_FILES = {
    "engine": ("EngineConfig", "varuna/engine/config.py"),
    "checkpoint": ("CheckpointConfig", "varuna/checkpoint/config.py"),
    "planner": ("PlannerConfig", "varuna/planner/config.py"),
    "elastic": ("ElasticConfig", "varuna/elastic/config.py"),
    "job": ("VarunaConfig", "varuna/engine/config.py"),
}


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type(annotation: str) -> str:
    """An annotation as code spans joined by an escaped pipe (`int` \\| `None`): a pipe inside a code
    span would split the table's cell on GitHub, and an escaped one shows its backslash on the site."""
    parts, depth, current = [], 0, ""
    for ch in " ".join(annotation.split()):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "|" and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return " \\| ".join(f"`{p}`" for p in parts)


def _fields(cls_name: str, path: str) -> dict[str, tuple[str, str | None, str]]:
    """name -> (type, default source or None, docstring) of a class's annotated fields, from its source."""
    tree = ast.parse((ROOT / path).read_text())
    source = (ROOT / path).read_text()
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out: dict[str, tuple[str, str | None, str]] = {}
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            doc = inspect.cleandoc(after.value.value)
        kind = ast.get_source_segment(source, node.annotation) or ""
        default = ast.get_source_segment(source, node.value) if node.value is not None else None
        out[node.target.id] = (kind, default, doc)
    return out


def options_table() -> str:
    from varuna.engine.config import OPTIONS

    rows = [
        "| option | type | default | owner | meaning |",
        "|---|---|---|---|---|",
    ]
    cache: dict[str, dict[str, tuple[str, str | None, str]]] = {}
    for part in ("engine", "checkpoint", "planner", "elastic", "job"):
        cls_name, path = COMPONENT_FILES[part]
        fields = cache.setdefault(part, _fields(cls_name, path))
        for name in [n for n in fields if OPTIONS.get(n) == part]:
            kind, default, doc = fields[name]
            if part == "job":  # VarunaConfig keeps the Path; Varuna(...) takes a str too
                kind, default = "str | Path | None", "None"
            if not doc:
                raise SystemExit(f"gen_config: {cls_name}.{name} has no docstring; write one in {path}")
            shown = f"`{default}`" if default is not None else "required"
            rows.append(
                f"| `{name}` | {_type(kind)} | {_one_line(shown)} | `{cls_name}` | {_one_line(doc)} |"
            )
    listed = {r.split("`")[1] for r in rows[2:]}
    missing = set(OPTIONS) - listed
    if missing:
        raise SystemExit(f"gen_config: options without a component field: {sorted(missing)}")
    return "\n".join(rows)


def _init_parameters(path: str, cls_name: str) -> list[str]:
    """The keyword parameters of a class's `__init__`, from its source (no import: the engine imports torch)."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in [*init.args.args, *init.args.kwonlyargs] if a.arg != "self"]


def arguments_table() -> str:
    from varuna.engine.config import OPTIONS

    names: list[str] = []
    for path in ("varuna/auto.py", "varuna/engine/engine.py"):
        for name in _init_parameters(path, "Varuna"):
            if name not in OPTIONS and name not in names:
                names.append(name)
    unknown = [n for n in names if n not in ARGUMENTS]
    if unknown:
        raise SystemExit(f"gen_config: Varuna(...) arguments without a meaning in ARGUMENTS: {unknown}")
    rows = ["| argument | meaning |", "|---|---|"]
    rows += [f"| `{n}` | {ARGUMENTS[n]} |" for n in names]
    return "\n".join(rows)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT / "widgets" if "varuna_widgets" in path.parts else ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files() -> Iterator[Path]:
    for root in SOURCES:
        if root.is_dir():
            yield from sorted(root.rglob("*.py"))


def env_uses() -> dict[str, dict[str, set[str]]]:
    """VARUNA_* name -> {"read": modules, "set": modules}, from every string constant that is exactly
    the name: a dict key or an assignment target (`env["X"] = ...`) sets it for a child process; any
    other use (`os.environ.get("X")`, `env["X"]`, `ENV = "X"` read later) reads it."""
    uses: dict[str, dict[str, set[str]]] = {}
    for path in _python_files():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value)
            ):
                continue
            parent = parents.get(node)
            sets = (isinstance(parent, ast.Dict) and node in parent.keys) or (
                isinstance(parent, ast.Subscript) and not isinstance(parent.ctx, ast.Load)
            )
            listed = isinstance(parent, (ast.Tuple, ast.List, ast.Set))  # names in a list: dropped, secret
            how = "set" if sets else None if listed else "read"
            entry = uses.setdefault(node.value, {"read": set(), "set": set()})
            if how:
                entry[how].add(_module(path))
    return uses


def env_table() -> str:
    uses = env_uses()
    unknown = sorted(set(uses) - set(ENV_MEANINGS))
    if unknown:
        raise SystemExit(
            f"gen_config: environment variables without a meaning in ENV_MEANINGS (docs/gen_config.py): {unknown}"
        )
    gone = sorted(set(ENV_MEANINGS) - set(uses))
    if gone:
        raise SystemExit(f"gen_config: ENV_MEANINGS lists variables the source no longer uses: {gone}")
    rows = ["| variable | meaning | read by | set for child processes by |", "|---|---|---|---|"]
    for name in sorted(uses):
        who, meaning = ENV_MEANINGS[name]
        if who == "launcher":
            meaning = f"*Set by the launcher.* {meaning}"
        readers = ", ".join(f"`{m}`" for m in sorted(uses[name]["read"])) or "your script"
        setters = ", ".join(f"`{m}`" for m in sorted(uses[name]["set"])) or "-"
        rows.append(f"| `{name}` | {meaning} | {readers} | {setters} |")
    return "\n".join(rows)


def render() -> str:
    return f"""<!-- Generated by docs/gen_config.py: do not edit; run `python docs/gen_config.py > docs/configuration.md`. -->
# Configuration

## Options of `Varuna(...)`

`Varuna(model, *, global_batch_size, micro_batch_size, ..., **options)` takes one flat set of keyword
options. `varuna.VarunaConfig` routes each to the component that owns and validates it (the *owner*
column: `EngineConfig` in `varuna.engine.config`, `CheckpointConfig` in `varuna.checkpoint.config`,
`PlannerConfig` in `varuna.planner.config`, `ElasticConfig` in `varuna.elastic.config`); a misspelt
option is a `ConfigError` naming the closest valid ones. `engine.config.NAME` reads any of them back.

The defaults are the configs'. In `Varuna(...)`, `pipeline` and `data` default to the launcher's
(`varuna run --pipeline/--data`, else P = 1 and D = world size / P), and `pipeline="auto"` lets the
planner choose the shape ([Planning](planning.md)); `schedule=None` is `"1f1b"`; `run_dir=None` is
the launcher's run directory (`VARUNA_RUN_DIR`), and `resume=None` is `VARUNA_RESUME` when set.

{options_table()}

## Other arguments of `Varuna(...)`

{arguments_table()}

## Environment variables

Every `VARUNA_*` variable the package reads or sets: what it means, the modules that read it, and
the modules that set it in the environment of the processes they start. Those marked *set by the
launcher* are how `varuna run`, the agent and `varuna profile` tell their ranks about the job; set
the others yourself.

{env_table()}
"""


def main() -> None:
    sys.path.insert(0, str(ROOT))
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
