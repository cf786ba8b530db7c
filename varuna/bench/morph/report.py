"""The morph benchmark's report: what its numbers mean, how they come out of the event log, its table.

`varuna.bench.morph.driver` runs the job (in `varuna.bench.morph.job`) and the reference writes; this
module reads what they left:

    DEFINITIONS     every reported field, as it is measured
    analyse         rank 0's events + the supervisor's timestamped lines -> timeline, breakdown, rates
    format_table    the headline numbers, the timeline and its breakdown as aligned text

`varuna.bench.morph` exports `format_table` and `DEFINITIONS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from varuna.errors import LaunchError

if TYPE_CHECKING:
    from varuna.bench.morph.config import MorphBench
    from varuna.bench.morph.job import Lines

MB = 1e6

DEFINITIONS = {
    "t = 0": "time.time() just before `python -m varuna resize RUN -p P -d D` is started",
    "bytes": "the checkpoint's size, engine.last_checkpoint['bytes'] (its manifest's 'bytes')",
    "write_s": "engine.last_checkpoint['seconds'] on rank 0: engine.checkpoint() from gathering the "
    "tensors to the commit of checkpoints/latest (DCP save with the CRC-32 of every tensor's bytes "
    "computed in memory, fsync of every file, extra.json, manifest, renames)",
    "write_mb_s": "bytes / write_s / 1e6",
    "plain_write_mb_s": "bytes / seconds of an open-write(8 MiB chunks of one random block)-fsync of "
    "as many bytes to a new file in the run directory, one writer, into new page-cache pages as the "
    "checkpoint's are: `plain_write_settle_s` after the job, every file kept until the last is "
    "written; the median of `plain_write_repeats`",
    "write_fraction_of_plain": "write_mb_s / plain_write_mb_s",
    "plain_write_warm_mb_s": "the same write right after deleting the files of the plain writes, so "
    "that it reuses their just-freed pages (what plain_write_mb_s measured before it kept its files "
    "and waited: this VM's host had not yet taken those pages back); a reference, not the target's "
    "baseline, since the checkpoint's pages are not reused ones",
    "write_fraction_of_plain_warm": "write_mb_s / plain_write_warm_mb_s",
    "relaunch_s": "from the old job's last event (rank 0's engine.step() raising SystemExit 75, "
    "after its checkpoint) to the relaunched rank 0's module start (time.time() at import of the "
    "worker module: after Python started, varuna.launch.worker imported torch and the ranks met)",
    "load_s": "engine.resume_info['seconds'] on the relaunched rank 0: resolve, verify the manifest "
    "(presence and size of every file, CRC-32 of metadata.json and extra.json), read extra.json and the "
    "metadata, DCP load (each rank reads its tensors' bytes into them; every extent read is "
    "checked against its CRC-32 by one of the ranks that read it)",
    "request_to_resumed_step_s": "t = 0 to the end of the first step after the resume "
    "(engine.step() returned on rank 0)",
    "timeline_s": "each event's time since t = 0 (rank 0's events; supervisor lines as they arrive)",
    "breakdown_s": "consecutive differences of the timeline; they add up to request_to_resumed_step_s",
    "checkpoint_phases_s": "rank 0's wall seconds inside the calls varuna.checkpoint.layout.save makes while "
    "checkpointing: dcp.save (writing every byte, checksumming it, fsync), crc32 (every CRC-32 "
    "computation: of the tensors' bytes in memory inside dcp.save, of metadata.json and extra.json after "
    "it), fsync (every os.fsync, those inside dcp.save too), collectives (barrier, "
    "broadcast_object_list; they include waiting for the other ranks); crc32 and fsync overlap "
    "dcp.save; other = write_s - dcp.save - collectives (gathering tensors, extra.json, manifest, "
    "rank 0's fsyncs after dcp.save, renames)",
    "reference": "after the job, on the same filesystem: plain writes (new pages; reused pages; "
    "before the job); a CRC-32 pass reading back the committed checkpoint; dcp.save with DCP's "
    "stock writer (torch.save records) by one process of tensors of the checkpoint's keys and "
    "shapes; the wall time of `python -c 'import torch'`",
    "load_phases_s": "the same for the resume on the new rank 0: crc32 (of the small files in "
    "verify, and of the extents this rank checks inside dcp.load), dcp.load (every rank reads what "
    "its parameters and optimizer state need), other = load_s - dcp.load (verify, metadata, "
    "extra.json, placeholders, broadcast of the verdict)",
}


def one_event(events: list[dict[str, Any]], event: str, launch: int) -> dict[str, Any]:
    found = [e for e in events if e["event"] == event and e["launch"] == launch]
    if not found:
        raise LaunchError(f"the morph benchmark's event log has no {event!r} event for launch {launch}")
    return found[0]


def analyse(
    bench: MorphBench, events: list[dict[str, Any]], lines: Lines, request: dict[str, float]
) -> dict[str, Any]:
    t0 = request["t"]
    old = 1
    new = max(e["launch"] for e in events)
    ckpt = one_event(events, "checkpoint", old)
    stop_step = next(
        e for e in events if e["event"] == "step" and e["launch"] == old and e["step"] + 1 == ckpt["step"]
    )
    resumed_steps = [e for e in events if e["event"] == "step" and e["launch"] == new]
    engine_built = one_event(events, "engine_built", new)
    resume_info = engine_built["resume_info"]
    if not resume_info:
        raise LaunchError(f"launch {new} of the morph benchmark did not resume from a checkpoint")
    (P2, D2) = bench.to_shape
    marks = {
        "resize_command_returned": request["returned"],
        "stop_step_computed": stop_step["start"] + stop_step["step_s"],
        "checkpoint_committed": stop_step["t"],
        "old_job_exit_raised": one_event(events, "exit", old)["t"],
        "supervisor_morph_line": lines.first(r"varuna: morphing \d+x\d+ -> "),
        "new_job_launched": lines.first(rf"varuna: {P2 * D2} ranks \(pipeline {P2} x data {D2}\)"),
        "new_process_started": one_event(events, "process_start", new)["t"],
        "new_module_started": one_event(events, "module_start", new)["t"],
        "new_imports_done": one_event(events, "imported", new)["t"],
        "new_model_built": one_event(events, "model_built", new)["t"],
        "new_engine_built": engine_built["t"],
        "new_optimizer_set": one_event(events, "optimizer_set", new)["t"],
        "first_resumed_step_end": resumed_steps[0]["t"],
    }
    timeline = {k: (round(v - t0, 3) if v is not None else None) for k, v in marks.items()}
    breakdown: dict[str, float] = {}
    known = [(k, v) for k, v in marks.items() if v is not None and k != "resize_command_returned"]
    labels = {
        "stop_step_computed": "request_to_stop_agreed (rest of the step in flight)",
        "checkpoint_committed": "checkpoint (engine.checkpoint, collective)",
        "old_job_exit_raised": "to the exit at the next step() call",
        "supervisor_morph_line": "old job teardown (MPI finalize, mpiexec exit, supervisor)",
        "new_job_launched": "supervisor to the new mpiexec",
        "new_process_started": "mpiexec starting the ranks",
        "new_module_started": "Python start, import torch, rendezvous (varuna.launch.worker)",
        "new_imports_done": "import varuna.engine.engine (torch.distributed.checkpoint), .data, .models",
        "new_model_built": "model construction (GPT init)",
        "new_engine_built": "Varuna(...): trace, partition, groups, broadcast, resume",
        "new_optimizer_set": "AdamW(...) (first one imports torch._dynamo) + set_optimizer",
        "first_resumed_step_end": "first resumed step (batch + step)",
    }
    prev = t0
    for k, v in known:
        breakdown[labels[k]] = round(v - prev, 3)
        prev = v
    load_s = float(resume_info["seconds"])
    engine_s = marks["new_engine_built"] - marks["new_model_built"]
    breakdown_engine = {"load (resume_info seconds)": round(load_s, 3), "rest": round(engine_s - load_s, 3)}
    nbytes = int(ckpt["bytes"])
    write_s = float(ckpt["seconds"])
    ckpt_phases = dict(ckpt.get("phases") or {})
    if ckpt_phases:
        inside = sum(ckpt_phases.get(k, 0.0) for k in ("dcp.save", "collectives"))
        ckpt_phases["other"] = round(write_s - inside, 4)
    load_phases = dict(engine_built.get("phases") or {})
    if load_phases:
        load_phases["other"] = round(load_s - load_phases.get("dcp.load", 0.0), 4)
    relaunch_s = marks["new_module_started"] - marks["old_job_exit_raised"]
    return {
        "bytes": nbytes,
        "write_s": round(write_s, 3),
        "write_mb_s": round(nbytes / write_s / MB, 1),
        "relaunch_s": round(relaunch_s, 3),
        "load_s": round(load_s, 3),
        "load_mb_s": round(nbytes / load_s / MB, 1) if load_s > 0 else None,
        "request_to_resumed_step_s": round(marks["first_resumed_step_end"] - t0, 3),
        "request_command_s": round(request["returned"] - t0, 3),
        "checkpoint_step": ckpt["step"],
        "early_checkpoint": next(
            (
                {k: e[k] for k in ("step", "bytes", "seconds", "phases") if k in e}
                for e in events
                if e["event"] == "early_checkpoint"
            ),
            None,
        ),
        "timeline_s": timeline,
        "breakdown_s": breakdown,
        "engine_construction_s": breakdown_engine,
        "checkpoint_phases_s": ckpt_phases,
        "load_phases_s": load_phases,
        "step_s": {
            "before": [round(e["step_s"], 3) for e in events if e["event"] == "step" and e["launch"] == old],
            "after": [round(e["step_s"], 3) for e in resumed_steps],
        },
        "losses": {
            "before": [round(e["loss"], 5) for e in events if e["event"] == "step" and e["launch"] == old],
            "after": [round(e["loss"], 5) for e in resumed_steps],
        },
    }


def format_table(report: dict[str, Any]) -> str:
    """The headline numbers, the timeline and its breakdown as aligned text."""
    m, t = report["model"], report["targets"]
    c = m["config"]
    lines = [
        f"GPT {c.get('n_layer')} blocks, d_model {c.get('d_model')}, vocab {c.get('vocab_size')}, seq "
        f"{c.get('seq_len')}: {report['params'] / 1e6:.1f}M params, AdamW; batch {m['global_batch_size']} "
        f"in micro-batches of {m['micro_batch_size']}; {report['from_shape']} -> {report['to_shape']} on "
        f"{m['host_cores']} cores (load {m['load_before'][0]:.2f} before, {m['load_after_job'][0]:.2f} after the job)",
        f"checkpoint {report['bytes'] / MB:.0f} MB in {report['write_s']:.2f} s = {report['write_mb_s']:.0f} MB/s; "
        f"plain write {report['plain_write_mb_s']:.0f} MB/s (into reused pages: {report['plain_write_warm_mb_s']:.0f}); "
        f"fraction {report['write_fraction_of_plain']:.2f} (of reused: {report['write_fraction_of_plain_warm']:.2f}) "
        f"(target {t['write_fraction_of_plain']['target']}: {'met' if t['write_fraction_of_plain']['met'] else 'NOT met'})",
        f"request -> first resumed step {report['request_to_resumed_step_s']:.2f} s (target "
        f"{t['request_to_resumed_step_s']['target']}: {'met' if t['request_to_resumed_step_s']['met'] else 'NOT met'}); "
        f"relaunch {report['relaunch_s']:.2f} s; load {report['load_s']:.2f} s",
        "",
    ]
    w = max(len(k) for k in report["breakdown_s"])
    lines.append(f"{'since the request':<{w + 4}} {'s':>8}")
    for label, seconds in report["breakdown_s"].items():
        lines.append(f"  + {label:<{w}} {seconds:>8.2f}")
    lines.append(f"  = {'first resumed step ends':<{w}} {report['request_to_resumed_step_s']:>8.2f}")
    for title, key in (("checkpoint", "checkpoint_phases_s"), ("load", "load_phases_s")):
        if report.get(key):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in report[key].items())
            lines.append(f"{title} phases (rank 0, s): {parts}")
    steps = report["step_s"]
    lines.append(
        f"step s before: {', '.join(f'{s:.2f}' for s in steps['before'])}; after: "
        f"{', '.join(f'{s:.2f}' for s in steps['after'])}; wall time {report['wall_s']:.0f} s"
    )
    return "\n".join(lines)
