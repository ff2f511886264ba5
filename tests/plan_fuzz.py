"""Seeded random plans: tiny shapes of the served families x random ``autopart plan`` options.

Every case draws a family and a shape (hidden size, layers, heads, vocabulary, tied head),
profiles it (analytical, or on the CPU for a few), and runs ``autopart plan`` with random
options: ``--pp`` or ``--devices`` with ``--tp`` / ``--dp`` / ``--zero``, the schedule,
``--virtual-stages``, ``--microbatches`` or ``--global-batch-size``, the granularity (its
names and schema 1's), ``--head``, the memory limit, ``--cuts`` named by any module that
ends at a cut, ``--precision`` and ``--format``. Each must end in a plan (exit 0) or in one
line (exit 2): a traceback, another exit code or a message over one line is a failure.
A sample of the plans that run on one CPU (``--pp`` 2 or 4, no mesh) is trained on gloo
ranks against the unpipelined model (loss and every gradient within 1e-5, fp32).

Used by ``tests/test_plan_fuzz.py`` (a fixed seed, ~30 cases) and
``scripts/plan_fuzz.py`` (any seed and size).
"""

from __future__ import annotations

import contextlib
import io
import random
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gpt2", "mixtral", "phi3",
            "olmo2", "qwen3_moe")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv",
             "dualpipev")
GRANULARITIES = ("auto", "layer", "half", "projection", "slice", "sublayer", "quarter")
FORMATS = ("table", "json", "nxd", "nemo", "torchtitan", "megatron")


@dataclass
class Case:
    """One fuzz case: a model shape and the ``autopart plan`` arguments."""

    index: int
    family: str
    shape: dict[str, Any]
    backend: str
    argv: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """Names the profile (cases of one shape and backend share it)."""
        return f"{self.family}-{'-'.join(f'{k}{v}' for k, v in sorted(self.shape.items()))}" \
               f"-{self.backend.replace(':', '_')}"


@dataclass
class Outcome:
    """How a case ended: ``plan``, ``refused`` (one line, exit 2) or ``failed``."""

    case: Case
    result: str
    message: str = ""
    plan_path: Path | None = None


def config_of(case: Case):
    """The case's tiny HF config (dropout and router jitter off: ``families.tiny_config``)."""
    from families import tiny_config

    shape = dict(case.shape)
    if case.family == "gpt2":
        shape = {"n_embd": shape.pop("hidden_size"), "n_layer": shape.pop("num_hidden_layers"),
                 "n_head": shape.pop("num_attention_heads"), **shape}
        shape.pop("num_key_value_heads", None)
        shape.pop("intermediate_size", None)
    return tiny_config(case.family, **shape)


def draw_case(rng: random.Random, index: int) -> Case:
    """A family, a shape and a backend (a fifth of the cases measure on the CPU)."""
    family = rng.choice(FAMILIES)
    heads = 4
    shape = {"hidden_size": rng.choice([32, 48, 64]), "num_hidden_layers": rng.choice([2, 3, 4, 6]),
             "num_attention_heads": heads, "num_key_value_heads": rng.choice([2, 4]),
             "vocab_size": rng.choice([96, 160, 256]), "intermediate_size": rng.choice([64, 96]),
             "tie_word_embeddings": rng.random() < 0.3}
    if family in ("qwen3", "gemma", "qwen3_moe"):
        shape["head_dim"] = shape["hidden_size"] // heads
    backend = "cpu" if rng.random() < 0.2 else "analytical:h100"
    return Case(index=index, family=family, shape=shape, backend=backend)


def draw_options(rng: random.Random, profile, case: Case) -> list[str]:
    """Random ``autopart plan`` arguments for ``profile``."""
    from autopart.solve.cuts import boundary_names

    args: list[str] = []
    if rng.random() < 0.3:
        args += ["--devices", str(rng.choice([2, 4, 8, 16, 64]))]
        if case.backend == "cpu":
            args += ["--device", "h100"]
        for flag in ("--tp", "--pp", "--dp"):
            if rng.random() < 0.3:
                args += [flag, str(rng.choice([1, 2, 4]))]
        if rng.random() < 0.3:
            args += ["--zero", "1"]
        args += ["--global-batch-size", str(rng.choice([8, 16, 64]))]
    else:
        pp = rng.choice([1, 2, 2, 3, 4, 4, 8])
        args += ["--pp", str(pp)]
        if rng.random() < 0.5:
            args += ["--microbatches", str(rng.choice([1, 2, 4, 8]))]
        elif rng.random() < 0.3:
            args += ["--global-batch-size", str(rng.choice([4, 8, 12]))]
        names = sorted(boundary_names(profile.blocks), key=lambda n: boundary_names(
            profile.blocks)[n])
        if rng.random() < 0.25 and len(names) >= pp - 1 > 0:
            args += ["--cuts", ",".join(rng.sample(names, pp - 1))]
    if rng.random() < 0.5:
        args += ["--schedule", rng.choice(SCHEDULES)]
    if rng.random() < 0.25:
        args += ["--virtual-stages", str(rng.choice([1, 2, 3]))]
    if rng.random() < 0.4:
        args += ["--granularity", rng.choice(GRANULARITIES)]
    if rng.random() < 0.2:
        args += ["--head", rng.choice(["auto", "split", "whole"])]
    if rng.random() < 0.2:
        args += ["--memory-limit", rng.choice(["1MiB", "64MiB", "4GiB", "none"])]
    if rng.random() < 0.15:
        args += ["--no-recompute"]
    if rng.random() < 0.2:
        args += ["--precision", rng.choice(["fp32", "bf16", "bf16-mixed"])]
    if rng.random() < 0.3:
        args += ["--format", rng.choice(FORMATS)]
    return args


def profile_of(case: Case, folder: Path) -> Path:
    """The case's profile JSON (made once per shape and backend)."""
    from autopart.intake.sources import build_hf_model
    from autopart.profile import profile_model

    path = folder / f"{case.key}.json"
    if not path.exists():
        fast = {"num_warmup": 0, "num_repeats": 1} if case.backend == "cpu" else {}
        profile_model(build_hf_model(config_of(case)), backend=case.backend, seq_len=16,
                      **fast).save(path)
    return path


def run_plan(case: Case, profile_path: Path, folder: Path) -> Outcome:
    """``autopart plan`` in this process: a plan, one refusal line, or a failure."""
    from cli.main import main

    plan_path = folder / f"plan{case.index}.json"
    argv = ["plan", str(profile_path), *case.argv, "--out", str(plan_path)]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException:  # noqa: BLE001 - any escape is what the fuzz looks for
        return Outcome(case, "failed", traceback.format_exc(limit=-3).strip())
    text = err.getvalue().strip()
    if code == 0:
        return Outcome(case, "plan", plan_path=plan_path)
    lines = [line for line in text.splitlines() if line.strip()]
    if code == 2 and len(lines) == 1 and "Traceback" not in text:
        return Outcome(case, "refused", lines[0])
    return Outcome(case, "failed", f"exit {code}: {text[-400:]}")


def cases(seed: int, num: int, folder: Path) -> list[tuple[Case, Path]]:
    """``num`` seeded cases with their profiles (made in ``folder``)."""
    rng = random.Random(seed)
    out = []
    for index in range(num):
        case = draw_case(rng, index)
        path = profile_of(case, folder)
        from autopart.schema import Profile

        case.argv = draw_options(rng, Profile.load(path), case)
        out.append((case, path))
    return out


TRAIN_BATCH = 4
"""Sequences in the batch a sampled plan trains on (``families.reference_run``)."""


def trainable(outcome: Outcome) -> bool:
    """A plan one CPU can run on 2 or 4 gloo ranks (no tensor or data parallelism) with at
    most as many microbatches as the batch has sequences."""
    if outcome.result != "plan":
        return False
    from autopart.schema import Plan

    plan = Plan.load(outcome.plan_path)
    return plan.tp_size == plan.dp_size == 1 and plan.pp_size in (2, 4) and \
        plan.num_microbatches <= TRAIN_BATCH


def train_worker(rank: int, world_size: int, case: Case, plan_path: str) -> dict:
    """One step of the plan on this rank against the unpipelined model (``exact_step``)."""
    from families import reference_run
    from runtime_helpers import exact_step

    from autopart.intake import discover_blocks
    from autopart.intake.sources import build_hf_model
    from autopart.runtime.builder import tied_parameters
    from autopart.schema import Plan

    config = config_of(case)
    reference = reference_run(config)
    model = build_hf_model(config)
    aliases = {b: a for a, b in tied_parameters(model, discover_blocks(model))}
    result = exact_step(config, Plan.load(plan_path), reference, aliases, recompute=False)
    return {"ref_loss": reference.loss, "ref_keys": sorted(reference.state), "plan": result}
