"""The CUDA paths on one GPU, run as a user runs them: ``autopart profile --backend cuda``
with the L2 flush (the default) and without it, the measured ``adopted_grad_bytes``, and
``autopart verify`` of a one-rank plan (pp 1, GPipe, m 4: one GPU suffices).

Usage: ``python scripts/cuda_check.py --out DIR [--models NAME,...]``. Writes the
configs, profiles, plans and the verify report under DIR, each command's output in
``DIR/log.txt``, and prints one table last: per model and flush, the profile's summed
block F and B, how many blocks measured weight gradients in their backward workspace,
and the pp-1 step and peak memory each profile predicts against what ``verify``
measured (the two plans run the same steps, so one run measures both). A pipeline of
two or more ranks needs as many GPUs (one rank per GPU under nccl); with one GPU the
plan for four is printed, not run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Model:
    """One generated model and its microbatch (bf16 on the GPU)."""

    name: str
    family: str
    config: dict
    mbs: int
    seq: int


MODELS = (
    # Llama 3.2 1B's shape: 128k vocabulary against hidden 2048
    Model("llama-1b", "llama", dict(hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=4096, tie_word_embeddings=False),
          2, 2048),
    Model("mixtral-small", "mixtral", dict(hidden_size=1024, intermediate_size=3584,
                                           num_hidden_layers=6, num_attention_heads=16,
                                           num_key_value_heads=8, vocab_size=32000,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           router_jitter_noise=0.0,
                                           max_position_embeddings=4096),
          4, 1024),
)


def run(cmd: list[str], log: Path, timeout: float = 300) -> tuple[int, str]:
    """Run one CLI command in ``log``'s folder (so ``-m`` finds the installed autopart,
    not a checkout's source tree); append its output to ``log``; return (exit code,
    output)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=log.parent)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"timed out after {timeout} s: {exc}"
    took = time.perf_counter() - start
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n(exit {code}, {took:.1f} s)\n\n")
    print(f"  exit {code} in {took:.1f} s: {' '.join(cmd[3:])}", flush=True)
    return code, out


def autopart(*args: str) -> list[str]:
    """The ``autopart`` command line through this interpreter."""
    return [sys.executable, "-m", "autopart.cli.main", *args]


def block_sums(path: Path) -> dict:
    """Summed F and B (ms) of a profile's layer-level blocks and its adopted gradients."""
    profile = json.loads(path.read_text())
    blocks = profile["blocks"]
    return {
        "fwd": sum(b["fwd_ms"] for b in blocks),
        "bwd": sum(b["bwd_ms"] for b in blocks),
        "blocks": len(blocks),
        "adopted": sum(1 for b in blocks if b.get("adopted_grad_bytes", 0) > 0),
        "adopted_bytes": sum(b.get("adopted_grad_bytes", 0) for b in blocks),
        "time_source": profile.get("setup", {}).get("time_source", "?"),
    }


def check_model(model: Model, out: Path, log: Path) -> dict:
    """Profile both ways and plan pp 1 (GPipe, m 4) from each; verify the plan from the
    flushed profile (both plans run the same steps: one measurement prices both); plan
    pp 4 from it to print the cuts."""
    from transformers import AutoConfig

    folder = out / model.name
    AutoConfig.for_model(model.family, **model.config).save_pretrained(folder)
    cfg = str(folder / "config.json")
    row: dict = {"model": model.name}
    shape = ["--micro-batch-size", str(model.mbs), "--seq-len", str(model.seq),
             "--dtype", "bfloat16"]
    for flush in ("llc", "none"):
        prof = out / f"{model.name}.{flush}.profile.json"
        code, _ = run(autopart("profile", cfg, "--backend", "cuda", *shape,
                               "--cache-flush", flush, "--out", str(prof)), log)
        if code:
            row[flush] = {"error": f"profile exit {code}"}
            continue
        row[flush] = block_sums(prof)
        plan = out / f"{model.name}.{flush}.pp1.json"
        code, _ = run(autopart("plan", str(prof), "--pp", "1", "--microbatches", "4",
                               "--schedule", "gpipe", "--out", str(plan)), log)
        if code:
            row[flush]["error"] = f"plan exit {code}"
            continue
        planned = json.loads(plan.read_text())
        row[flush]["pred_ms"] = planned["predicted_step_ms"]
        row[flush]["pred_mem"] = max(r["peak_memory_bytes"] for r in planned["ranks"])
    if "pred_ms" not in row.get("llc", {}):
        return row
    prof = out / f"{model.name}.llc.profile.json"
    run(autopart("plan", str(prof), "--pp", "4"), log)
    report = out / f"{model.name}.verify.json"
    code, _ = run(autopart("verify", str(out / f"{model.name}.llc.pp1.json"), "--model", cfg,
                           "--steps", "10", "--warmup", "3", "--json", str(report),
                           "--profile", str(prof)), log, timeout=400)
    if code:
        row["verify_error"] = f"verify exit {code}"
        return row
    measured = json.loads(report.read_text())
    row["meas_ms"] = measured["measured_step_ms"]
    row["meas_mem"] = max((r["measured_peak_memory_bytes"] for r in measured["ranks"]),
                          default=0)
    return row


def env_line() -> str:
    """Torch, GPU, L2 and the flush autopart writes."""
    import torch

    from autopart.profile.cuda_backend import l2_flush_bytes

    props = torch.cuda.get_device_properties(0)
    return (f"torch {torch.__version__}, {props.name}, {props.multi_processor_count} SMs, "
            f"L2 {getattr(props, 'L2_cache_size', 0) >> 20} MiB, flush "
            f"{l2_flush_bytes(props) >> 20} MiB")


def table(rows: list[dict]) -> str:
    """One line per model and flush."""
    lines = ["| model | flush | blocks F / B ms | blocks adopting grads (MiB) | pp 1 step "
             "pred / meas ms | err | peak pred / meas GiB | err |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for flush in ("llc", "none"):
            r = row.get(flush, {})
            if "fwd" not in r:
                lines.append(f"| {row['model']} | {flush} | {r.get('error', '-')} |||||")
                continue
            step = mem = se = me = row.get("verify_error", r.get("error", "-"))
            if "meas_ms" in row and "pred_ms" in r:
                step = f"{r['pred_ms']:.1f} / {row['meas_ms']:.1f}"
                se = f"{100 * (r['pred_ms'] - row['meas_ms']) / row['meas_ms']:+.1f}%"
                mem = f"{r['pred_mem'] / 2**30:.2f} / {row['meas_mem'] / 2**30:.2f}"
                me = (f"{100 * (r['pred_mem'] - row['meas_mem']) / row['meas_mem']:+.1f}%"
                      if row["meas_mem"] else "-")
            lines.append(f"| {row['model']} | {flush} | {r['fwd']:.2f} / {r['bwd']:.2f} | "
                         f"{r['adopted']} of {r['blocks']} ({r['adopted_bytes'] / 2**20:.0f}) "
                         f"| {step} | {se} | {mem} | {me} |")
    return "\n".join(lines)


def main() -> None:
    """Check every model; print the environment and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for configs, profiles, logs")
    parser.add_argument("--models", default=",".join(m.name for m in MODELS),
                        help="comma-separated subset of: "
                             + ", ".join(m.name for m in MODELS))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    env = env_line()
    print(env, flush=True)
    rows = []
    for model in MODELS:
        if model.name in args.models.split(","):
            print(f"{model.name}:", flush=True)
            rows.append(check_model(model, out, log))
            (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(env)
    print(table(rows))


if __name__ == "__main__":
    main()
