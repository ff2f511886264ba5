"""Sweep every causal-LM type transformers registers: build tiny, profile, plan, train exactly.

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: its default config shrunk by one
rule (``shrink``; per-family overrides in ``OVERRIDES``, each with why), kept when the
model runs forward and backward unpipelined on the CPU; then ``profile`` on the CPU at
the finest level, ``plan`` for pp 2 (1F1B, 4 microbatches) and one step on 2 gloo ranks
against the unpipelined model (loss and every gradient within 1e-5 of max(1, its
largest entry), as ``torch.allclose`` with atol = rtol = 1e-5; fp32, padded batch), and
where the profile lets the head be cut by vocabulary one more step of a plan with it cut
(the runtime's sliced loss, which a timing-chosen plan takes only sometimes), or one line
saying where and why not. Writes the table, with counts, to
``docs/families.md`` after every family (a partial run leaves a usable table).

Usage: python scripts/family_sweep.py [--only TYPE ...] [--merge] [--stage build|train]
[--out docs/families.md]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TOL = 1e-5
MAX_PARAMS = 40_000_000
"""A shrunk model larger than this kept a size the rule does not know; it is not run."""
TYPE_TIMEOUT_S = {"build": 120, "train": 900}
"""Seconds one type may take at each stage before the sweep records a timeout."""
SIZES = {
    "vocab_size": 96, "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "hidden_dim": 128,
    "num_hidden_layers": 4, "n_layer": 4, "num_layers": 4, "n_layers": 4,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
    "n_positions": 64, "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "sliding_window": 6, "attention_chunk_size": 6,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "rotary_dim": 8,
    "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 16,
    "encoder_hash_byte_group_vocab": 96,
}
"""The one rule: every size key a config has gets this value (ids point inside the
vocabulary); dropout, jitter and other probabilities become 0."""

OVERRIDES: dict[str, tuple[dict, str]] = {
    "mamba2": ({"num_heads": 8}, "its heads times head_dim must equal expand (2) times hidden"),
    "zaya": ({"num_experts_per_tok": 1}, "ZAYA routes top-1 only"),
    "bamba": ({"attn_layer_indices": [3]}, "its default has no attention layer at all"),
    "gemma3n_text": ({"layer_types": ["sliding_attention", "full_attention"] * 2,
                      "num_kv_shared_layers": 2},
                     "its last layers reuse the KV cache of an earlier layer of their type, "
                     "so both types come before the 2 sharing layers"),
    "granitemoehybrid": ({"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
                         "its default has no attention layer at all"),
    "gpt_oss": ({"intermediate_size": 64}, "experts' fused gate_up needs an even size"),
    "llama4_text": ({"num_experts_per_tok": 1, "intermediate_size_mlp": 128},
                    "its router is top-1; the dense MLP has its own size key"),
    "deepseek_v2": ({"first_k_dense_replace": 1}, "one dense layer as in the real models"),
    "deepseek_v3": ({"first_k_dense_replace": 1}, "one dense layer as in the real models"),
}
"""Per-family overrides where the rule alone cannot build a runnable model, with why."""


def shrink(model_type: str, extra: dict | None = None):
    """The default config of ``model_type`` with the rule (and its override, then
    ``extra``) applied.

    The config is built anew from the rule's values, so that what a config derives from
    its sizes in its constructor (MLA's ``qk_head_dim``, Bamba's ``layers_block_type``)
    follows them."""
    from transformers import AutoConfig

    rule = _rule(AutoConfig.for_model(model_type).to_dict(), model_type)
    rule.update(OVERRIDES.get(model_type, ({}, ""))[0])
    rule.update(extra or {})
    return AutoConfig.for_model(model_type, **rule)


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_DERIVED_WHEN_NONE = ("head_dim", "num_key_value_heads")
"""Size keys whose ``None`` means "derive it from the others": set like any other size."""


def _rule(values: dict, model_type: str) -> dict:
    """The rule's values for one config's ``to_dict()`` and every sub-config it holds.

    Sizes become ``SIZES``' values, found under the config's own names too (its
    ``attribute_map``: XLM's ``emb_dim`` is its hidden size); a size 0 (a feature off)
    stays 0. Key-value heads keep the
    default's grouping (a config with as many as query heads keeps as many); an MLA
    config's ``head_dim`` stays its rotary part (``qk_rope_head_dim``) or the whole
    query-key head, as in the default. Probabilities
    (dropout, jitter) become 0; every list with one entry per layer (layer types, block
    types) keeps its first entries, a dict of per-layer configs its first layers'; the
    embeddings are untied."""
    from transformers import CONFIG_MAPPING

    known = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    alias = {v: k for k, v in getattr(known, "attribute_map", {}).items()}
    layers = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), None)
    rule: dict = {}
    for key, value in values.items():
        name = key if key in SIZES else alias.get(key, key)
        if name in SIZES and value != 0 and (value is not None or name in _DERIVED_WHEN_NONE):
            rule[key] = SIZES[name]
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key
                                           or "jitter" in key):
            rule[key] = 0.0
        elif isinstance(value, dict) and "model_type" in value:
            rule[key] = {**value, **_rule(value, value["model_type"])}
    heads = values.get("num_attention_heads", values.get(alias_of(alias, "num_attention_heads")))
    if "num_key_value_heads" in values and values["num_key_value_heads"] in (None, heads):
        rule["num_key_value_heads"] = SIZES["num_attention_heads"]
    rope, nope = values.get("qk_rope_head_dim"), values.get("qk_nope_head_dim")
    if rope and values.get("head_dim") in (None, rope):  # MLA: head_dim is the rotary part
        rule["head_dim"] = SIZES["qk_rope_head_dim"]
    elif rope and nope and values.get("head_dim") == rope + nope:  # or the whole qk head
        rule["head_dim"] = SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"]
    for group in ("n_group", "num_expert_group"):  # group-limited routing, 4 experts
        if values.get(group) is not None:
            rule.update({group: 1, "topk_group": 1})
    experts = any(values.get(k) for k in _EXPERT_KEYS)
    if experts and values.get("num_experts_per_tok", 0) is None:
        rule["num_experts_per_tok"] = SIZES["num_experts_per_tok"]
    new_layers = next((rule[k] for k in _LAYER_KEYS if k in rule), None)
    if layers and new_layers and layers != new_layers:
        for key, value in values.items():
            if isinstance(value, list) and len(value) == layers:
                rule[key] = _every_kind(value, new_layers)
            elif key == "per_layer_config" and isinstance(value, dict):
                rule[key] = {i: c for i, c in value.items() if int(i) < new_layers}
            elif (key.endswith("_layer_period") and isinstance(value, int)
                  and value > new_layers // 2):  # a layer kind every `period` layers
                rule[key] = new_layers // 2
                offset = key.replace("_period", "_offset")
                if isinstance(values.get(offset), int):
                    rule[offset] = values[offset] % rule[key]
    if "tie_word_embeddings" in values:
        rule["tie_word_embeddings"] = False
    return rule


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _every_kind(per_layer: list, count: int) -> list:
    """The first ``count`` entries of a per-layer list, the last ones replaced by the
    kinds they lack (a hybrid stack whose first full-attention layer is its sixth keeps
    one), so the shrunk model has every kind of layer the default has."""
    kept = list(per_layer[:count])
    missing = [k for k in dict.fromkeys(map(repr, per_layer)) if k not in map(repr, kept)]
    by_repr = {repr(v): v for v in per_layer}
    for i, kind in enumerate(missing[:count - 1]):
        kept[count - 1 - i] = by_repr[kind]
    return kept


def alias_of(alias: dict, name: str) -> str:
    """The config's own key for the standard ``name`` (``alias`` maps own keys to names)."""
    return next((own for own, standard in alias.items() if standard == name), name)


def _first_line(exc: BaseException) -> str:
    """``Type: message`` in one table cell; a rank's failure by its own last line."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if type(exc).__name__ == "ProcessRaisedException" and lines:
        return f"a rank failed: {lines[-1].strip()[:160]}".replace("|", "/")
    text = (lines or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {text[:160]}".replace("|", "/")


def _train_worker(rank: int, world_size: int, model_type: str, plan, extra: dict) -> dict:
    from families import Reference, init_real
    from runtime_helpers import exact_step, padded_batch

    from autopart.intake import discover_blocks
    from autopart.intake.sources import build_hf_model
    from autopart.runtime.builder import tied_parameters

    config = shrink(model_type, extra)
    torch.manual_seed(0)
    model = init_real(build_hf_model(config))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vocab = config.get_text_config().vocab_size
    ids, mask, labels = padded_batch(vocab, batch=4, seq_len=12)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    reference = Reference(state, ids, mask, labels, out.loss.item(), grads)
    meta = build_hf_model(shrink(model_type, extra))
    aliases = {b: a for a, b in tied_parameters(meta, discover_blocks(meta))}
    result = exact_step(shrink(model_type, extra), plan, reference, aliases, False)
    result["ref_loss"] = reference.loss
    return result


def _fork_ranks(fn, world_size: int, tmp_path: Path, *args) -> list:
    """``runtime_helpers.run_ranks`` with forked ranks: this process has torch and
    transformers imported already, where a spawned rank imports them again (seconds)."""
    import json

    import torch.multiprocessing as mp
    from runtime_helpers import _free_port, _worker

    mp.start_processes(_worker, args=(world_size, _free_port(), str(tmp_path), fn, args),
                       nprocs=world_size, join=True, start_method="fork")
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def _default_build_error(model_type: str) -> str:
    """Why transformers cannot build ``model_type`` from its own default config (on meta,
    nothing allocated), or ``""`` when it can: the rule is not what breaks such a type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as exc:  # noqa: BLE001 - the reason is the row's
        return _first_line(exc)
    return ""


def sweep_one(model_type: str, stage: str = "train", extra: dict | None = None) -> dict:
    """One row: build, unpipelined run, profile, plan, exact training (or why not);
    ``stage`` ``build`` stops after the unpipelined run (a fast pass over every type).
    ``extra``: config values over the rule's. An encoder type autopart refuses is tried
    as a decoder too (``is_decoder=True``), and the row says how that went."""
    from families import init_real
    from runtime_helpers import padded_batch

    from autopart.errors import ModelSourceError
    from autopart.intake.sources import build_hf_model
    from autopart.profile import profile_model
    from autopart.solve import make_plan

    row = {"type": model_type, "profile": "", "plan": "", "exact": "", "level": "",
           "reason": ""}
    try:
        config = shrink(model_type, extra)
        torch.manual_seed(0)
        model = build_hf_model(config)
        count = sum(p.numel() for p in model.parameters())
        if count > MAX_PARAMS:
            raise ValueError(f"the rule leaves {count / 1e6:.0f}M parameters (more than "
                             f"{MAX_PARAMS / 1e6:.0f}M): a size key it does not know")
        model = init_real(model)
        vocab = config.get_text_config().vocab_size
        ids, mask, labels = padded_batch(vocab, batch=2, seq_len=12)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    except BaseException as exc:  # noqa: BLE001 - any failure is the row's reason
        if any(words in str(exc) for words in _REFUSALS) and not extra:
            row["reason"] = f"refused: {str(exc).split(';')[0]}"
            if stage == "train" and "is an encoder:" in str(exc):
                decoder = sweep_one(model_type, stage, {"is_decoder": True})
                row["reason"] += "; as a decoder (is_decoder=True): " + (
                    "exact" if decoder["exact"] == "yes" else decoder["reason"] or "not exact")
            return row
        row["reason"] = f"does not run unpipelined: {_first_line(exc)}"
        default = "" if extra else _default_build_error(model_type)
        if default and "cannot build" in row["reason"]:
            row["reason"] = f"does not run unpipelined: transformers' default config does " \
                            f"not build either: {default}"
        return row
    if stage == "build":
        return row
    try:
        profile = profile_model(build_hf_model(shrink(model_type, extra)), backend="cpu", seq_len=8,
                                num_warmup=0, num_repeats=1)
        row["profile"], row["level"] = "yes", profile.setup.granularity
    except BaseException as exc:  # noqa: BLE001
        row["profile"], row["reason"] = "no", _first_line(exc)
        if isinstance(exc, ModelSourceError) and any(w in str(exc) for w in _UNSPLITTABLE):
            row["reason"] = f"refused: {exc}".replace("|", "/")[:220]
        return row
    try:
        plans = {"": make_plan(profile, pp_size=2, schedule="1f1b", num_microbatches=4)}
        if profile.model.head_split_rows:  # the split head's own path, whatever timing chose
            plans["with the head split: "] = make_plan(profile, pp_size=2, schedule="1f1b",
                                                       num_microbatches=4, split_head=True)
        row["plan"] = "yes"
    except BaseException as exc:  # noqa: BLE001
        row["plan"], row["reason"] = "no", _first_line(exc)
        return row
    row["exact"] = "yes"
    for which, plan in plans.items():
        try:
            with tempfile.TemporaryDirectory() as tmp:
                results = _fork_ranks(_train_worker, 2, Path(tmp), model_type, plan, extra)
            losses = [r["loss"] for r in results if r["loss"] is not None]
            diff = max(r["max_scaled_grad_diff"] for r in results)
            loss_diff = abs(losses[0] - results[0]["ref_loss"])
            if len(losses) != 1 or loss_diff >= TOL * max(1.0, abs(results[0]["ref_loss"])) \
                    or diff >= TOL:
                worst = max(results, key=lambda r: r["max_scaled_grad_diff"])["worst_scaled"]
                row["exact"], row["reason"] = "no", (
                    f"{which}loss off by {loss_diff:.1e}, gradient of {worst} by {diff:.1e} "
                    f"of max(1, its largest entry)")
                return row
        except BaseException as exc:  # noqa: BLE001
            row["exact"], row["reason"] = "no", which + _first_line(exc)
            return row
    return row


_REFUSALS = ("encoder-decoder model", "has no causal LM", "is an encoder:")
"""Words of autopart's one-line refusals of types it does not pipeline."""


_UNSPLITTABLE = ("outside its blocks", "more than once", "reads the values of its blocks")
"""Words of autopart's one-line refusals of decoder-only models it cannot split."""


def _refused(row: dict) -> bool:
    """autopart refused the type in one line (encoder-decoder, encoder, no causal LM)."""
    return any(words in row["reason"] for words in _REFUSALS)


def read_table(path: Path) -> list[dict]:
    """The rows of a table ``write_table`` wrote (to rewrite it with ``--retable``)."""
    keys = ("type", "profile", "plan", "exact", "level", "reason")
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] not in ("type", "---"):
            rows.append(dict(zip(keys, cells)))
    return rows


def write_table(rows: list[dict], out: Path, total: int, seconds: float) -> None:
    """``docs/families.md``: counts, then one row per type."""
    noncausal = [r for r in rows if _refused(r)]
    not_run = [r for r in rows if r["reason"].startswith("does not run")]
    broken = [r for r in not_run if "default config does not build" in r["reason"]]
    runs = [r for r in rows if r not in not_run and r not in noncausal]
    unsplittable = [r for r in runs if r["reason"].startswith("refused:")]
    trained = [r for r in runs if r not in unsplittable]
    exact = [r for r in trained if r["exact"] == "yes"]
    share = f" ({100 * len(exact) / len(trained):.1f}%)" if trained else ""
    lines = [
        "# Causal-LM families of transformers under autopart",
        "",
        *([f"PARTIAL: the sweep covered {len(rows)} of {total} types; rerun it for the rest.",
           ""] if len(rows) < total else []),
        "Written by `python scripts/family_sweep.py` (tiny configs by one rule, CPU, "
        "2 gloo ranks, 1F1B, 4 microbatches, padded batch, fp32, tolerance 1e-5 of max(1, "
        "the largest entry); where the profile lets the head be cut by vocabulary, a second "
        "plan with it cut trains too).",
        "",
        f"- types swept: {len(rows)} of {total} in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`"
        + (f" ({seconds / 60:.0f} min)" if seconds else ""),
        f"- refused in one line as encoder-decoder or encoder (non-causal): {len(noncausal)}",
        f"- not running unpipelined on the shrunk config: {len(not_run)} ({len(broken)} of "
        f"them: transformers cannot build its own default config either)",
        f"- run unpipelined on the shrunk config: {len(runs)}",
        f"  - refused in one line by autopart as not splittable (a parameter used outside "
        f"every block, a block called twice, block outputs read as values): "
        f"{len(unsplittable)}",
        f"  - profiled, planned and trained: {len(trained)}",
        f"- train exactly (loss and every gradient within 1e-5 of max(1, its largest entry)): "
        f"{len(exact)} of "
        f"{len(trained)}{share}; {len(exact)} of all {len(runs)} that run unpipelined",
        "",
        "Overrides of the rule: " + "; ".join(f"`{k}` {v[0]} ({v[1]})"
                                               for k, v in OVERRIDES.items()),
        "",
        "| type | profile | plan | exact | finest level | reason |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['type']} | {r['profile']} | {r['plan']} | {r['exact']} | {r['level']} "
              f"| {r['reason']} |" for r in rows]
    out.write_text("\n".join(lines) + "\n")


def _timeout(signum, frame) -> None:
    """SIGALRM: the type took longer than ``TYPE_TIMEOUT_S`` allows."""
    raise TimeoutError("took longer than the sweep allows one type (TYPE_TIMEOUT_S)")


def main() -> int:
    """Run the sweep (see the module docstring)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these model types only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "families.md")
    parser.add_argument("--stage", choices=("build", "train"), default="train",
                        help="build: only build and run each type unpipelined (seconds a type)")
    parser.add_argument("--merge", action="store_true",
                        help="keep --out's rows of the types not swept now (rerun a few)")
    parser.add_argument("--retable", action="store_true",
                        help="rewrite --out from its own rows (counts, classification)")
    args = parser.parse_args()
    if args.retable:
        write_table(read_table(args.out), args.out, len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), 0)
        return 0
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # ranks are forked from this process (fork-safe: one thread)
    signal.signal(signal.SIGALRM, _timeout)
    logging.disable(logging.WARNING)
    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(args.only or ()) - set(types))
    if unknown:
        print(f"family_sweep: not causal-LM types of transformers: {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    if args.only:
        types = [t for t in types if t in args.only]
    kept = [r for r in read_table(args.out) if r["type"] not in types] \
        if args.merge and args.out.exists() else []
    rows, start = [], time.time()
    for model_type in types:
        t0 = time.time()
        signal.alarm(TYPE_TIMEOUT_S[args.stage])
        try:
            row = sweep_one(model_type, args.stage)
        except BaseException:  # noqa: BLE001 - the sweep goes on
            row = {"type": model_type, "profile": "", "plan": "", "exact": "", "level": "",
                   "reason": traceback.format_exc().strip().splitlines()[-1][:160]}
        signal.alarm(0)
        rows = sorted([*[r for r in rows if r["type"] != model_type], row],
                      key=lambda r: r["type"])
        print(f"{model_type}: {row['exact'] or row['profile'] or '-'} {row['level']} "
              f"{row['reason']} ({time.time() - t0:.0f} s)", flush=True)
        write_table(sorted(kept + rows, key=lambda r: r["type"]), args.out,
                    len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), 0 if kept else time.time() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
