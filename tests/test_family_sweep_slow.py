"""The family sweep's whole path on a fixed, representative handful of types (CI subset).

``scripts/family_sweep.py`` runs in a process of its own (its ranks are forked from it)
over: a dense Llama-like model, an MoE (Mixtral), hybrid linear attention (Qwen3-Next),
MLA with a dense first layer (DeepSeek-V2), a Mamba hybrid whose stage gradients are
not contiguous (Zamba), a model whose halves read a convolution's weight themselves
(LFM3), GPT-1 (no ``_no_split_modules``, weights set in its constructor), sparse
attention whose integer top-k indices cross the cut (Hy-V4), a loss on unshifted
labels (CPM-Ant), RecurrentGemma and Gemma 2 (soft-capped logits: each type whose head
can be cut by vocabulary trains a second plan with it cut), CTRL (its code scales a
block's output in place, which the profile's glue pass once refused), an encoder
refused unless it is a decoder (BERT) and an encoder-decoder refused in one line (BART).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("family_sweep",
                                               ROOT / "scripts" / "family_sweep.py")
family_sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(family_sweep)

EXACT = ["llama", "mixtral", "qwen3_next", "deepseek_v2", "zamba", "lfm3", "openai-gpt",
         "hy_v4", "cpmant",
         "recurrent_gemma",  # a split half keeping a real buffer: its walk is timed on meta
         "gemma2",  # its soft-capped logits, repeated on each slice of a split head
         "ctrl"]  # scales its embedding's output in place, in the model's own code
REFUSED = {"bart": "refused: model_type 'bart' is an encoder-decoder model",
           "bert": "as a decoder (is_decoder=True): exact"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_sweep_subset_trains_exactly_or_refuses_in_one_line(tmp_path):
    """Every type of the subset trains exactly (1F1B, 2 gloo ranks, loss and every
    gradient within 1e-5 of max(1, its largest entry)) or is refused in one line; the
    table's counts add up."""
    out = tmp_path / "families.md"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "family_sweep.py"),
                          "--only", *EXACT, *REFUSED, "--out", str(out)],
                         capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["type"]: r for r in family_sweep.read_table(out)}
    assert set(rows) == set(EXACT) | set(REFUSED)
    for model_type in EXACT:
        # the reason first: pytest cuts a long dict short before it
        assert rows[model_type]["exact"] == "yes", \
            f"{model_type} not exact: {rows[model_type]['reason']} ({rows[model_type]})"
    for model_type, words in REFUSED.items():
        assert words in rows[model_type]["reason"], rows[model_type]
        assert rows[model_type]["exact"] == ""
    text = out.read_text()
    assert (f"- train exactly (loss and every gradient within 1e-5 of max(1, its largest "
            f"entry)): {len(EXACT)} of {len(EXACT)}") in text
    assert "Traceback" not in text and "Traceback" not in run.stdout
