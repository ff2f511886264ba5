"""profile_model on cpu: structure, reuse, generic chains, bad input, the model left unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import hold_steady
from torch import nn

from autopart.errors import ProfileError
from autopart.intake import load_model
from autopart.levels import coarsen
from autopart.profile import profile_model
from autopart.profile.backends import Backend
from autopart.profile.measure import measure_times
from autopart.profile.tasks import BlockTask
from autopart.schema import Part, Profile

FAST = {"num_warmup": 1, "num_repeats": 2, "seq_len": 16}
TIMES = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms")


@pytest.fixture(scope="module")
def tiny() -> Profile:
    with pytest.MonkeyPatch.context() as patch:
        hold_steady(patch)
        return profile_model("tiny-llama", **FAST)


# --- structure ---------------------------------------------------------------------------------


def test_blocks_follow_the_chain(tiny):
    """The default profile holds the finest level: each layer's halves cut before their
    output projection, every piece a part of its half's module and of its layer; the
    layer level fuses them back into the layers."""
    pieces = ["self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"]
    assert [b.name for b in tiny.blocks] == [
        "model.embed_tokens", *(f"model.layers.{i}.{p}" for i in range(4) for p in pieces),
        "model.norm", "lm_head"]
    assert tiny.setup.granularity == "projection"
    assert tiny.blocks[3].parts == (
        Part(module="model.layers.0", axis="calls", index=1, count=2),
        Part(module="model.layers.0.mlp", axis="calls", index=0, count=2))
    layers = coarsen(tiny, "layer")
    assert [b.name for b in layers.blocks] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
        "model.layers.3", "model.norm", "lm_head"]
    assert [b.kind for b in layers.blocks] == (["embedding"] + ["decoder_layer"] * 4
                                               + ["norm", "head"])
    assert [b.name for b in coarsen(tiny, "half").blocks[1:3]] == [
        "model.layers.0.self_attn", "model.layers.0.mlp"]


def test_every_block_is_timed(tiny):
    for b in tiny.blocks:
        assert b.fwd_ms > 0 and b.bwd_ms > 0, b
    assert tiny.blocks[0].bwd_input_ms == 0.0  # token ids have no gradient


# --- F, B and W on a virtual clock: exact values -----------------------------------------------

_CLOCK = [0.0]
"""Virtual milliseconds: advanced only by ``_Cost``, read by ``_VirtualBackend``."""


class _Cost(torch.autograd.Function):
    """Identity whose forward costs ``fwd_ms`` and whose backward costs ``bwd_ms``."""

    @staticmethod
    def forward(ctx, t, fwd_ms, bwd_ms):
        _CLOCK[0] += fwd_ms
        ctx.bwd_ms = bwd_ms
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        _CLOCK[0] += ctx.bwd_ms
        return grad, None, None


class _VirtualBlock(nn.Module):
    """``x + w``: the x branch costs 1 ms forward and 3 ms backward, the w branch 1 and 5."""

    def __init__(self, weight: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4)) if weight else None

    def forward(self, x):
        out = _Cost.apply(x, 1.0, 3.0)
        return out + _Cost.apply(self.w, 1.0, 5.0) if self.w is not None else out


class _VirtualBackend(Backend):
    def time(self, fn, hot=(), warm=None):
        start = _CLOCK[0]
        out = fn()
        return _CLOCK[0] - start, out


@pytest.mark.parametrize("weight, input_grad, expected", [
    # F = both branches; full backward = both; B = the x branch only (autograd skips w's
    # node when asked for x's gradient); W = full - B = the w branch.
    (True, True, (2.0, 8.0, 3.0, 5.0)),
    # No input gradient (an embedding's token ids): B = 0 and W = the whole backward.
    (True, False, (2.0, 5.0, 0.0, 5.0)),
    # No weights: the whole backward is B and W = 0.
    (False, True, (1.0, 3.0, 3.0, 0.0)),
])
def test_f_b_w_on_a_virtual_clock(weight, input_grad, expected):
    block = _VirtualBlock(weight)
    x = torch.randn(4).requires_grad_(input_grad)
    task = BlockTask(run=block, inputs=x, input_grad=input_grad, loss_output=False,
                     module=block)
    t = measure_times(task, _VirtualBackend(), num_warmup=1, num_repeats=3)
    assert (t.fwd_ms, t.bwd_ms, t.bwd_input_ms, t.bwd_weight_ms) == expected
    assert t.fwd_ms_spread == 0.0 and t.bwd_ms_spread == 0.0
    # torch's split backward runs the same branches (B: x's, W: w's): nothing extra on a
    # clock that only the branches advance
    assert t.split_extra_ms == 0.0


def test_torch_split_backward_costs_more_than_the_full_one():
    """On the real clock a linear layer's B + W as zero-bubble schedules run them
    (``stage_backward_input``, ``stage_backward_weight``: a graph walk, the weight's
    gradient made apart and added) take longer than its full backward."""
    block = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    task = BlockTask(run=block, inputs=x, input_grad=True, loss_output=False, module=block)
    t = measure_times(task, Backend(), num_warmup=2, num_repeats=5)
    assert t.split_extra_ms > 0
    assert block.weight.grad is None and x.grad is None  # nothing left behind


def test_exact_sizes(tiny):
    """Sizes against the tiny-llama config: hidden 64, vocab 512, kv heads 2 of dim 16."""
    hidden, vocab, inter, kv = 64, 512, 176, 32
    blocks = coarsen(tiny, "layer").blocks
    embed, layer, norm, head = blocks[0], blocks[1], blocks[5], blocks[6]
    assert embed.num_params == vocab * hidden and embed.param_bytes == vocab * hidden * 4
    attention, mlp, norms = 2 * hidden * hidden + 2 * hidden * kv, 3 * hidden * inter, 2 * hidden
    assert layer.num_params == attention + mlp + norms
    assert norm.num_params == hidden and head.num_params == vocab * hidden
    assert embed.output_bytes == layer.output_bytes == norm.output_bytes == 16 * hidden * 4
    assert head.output_bytes == 4  # the float32 loss
    assert embed.activation_bytes == 16 * 8  # the int64 token ids the embedding backward needs
    assert tiny.model.num_params == sum(b.num_params for b in tiny.blocks)
    assert sum(b.fwd_ms for b in blocks) == pytest.approx(sum(b.fwd_ms for b in tiny.blocks))


def test_setup_and_model_info(tiny):
    s = tiny.setup
    assert (s.backend, s.dtype, s.micro_batch_size, s.seq_len) == ("cpu", "float32", 1, 16)
    assert s.torch_version == torch.__version__ and s.transformers_version
    assert s.num_threads == torch.get_num_threads() and s.num_repeats == 2
    assert s.time_source.startswith("measured") and s.memory_source.startswith("measured")
    # the cpu default: the model's own weights' worth read before each timed call
    assert "weights' worth read" in s.time_source
    assert f"({tiny.model.num_params * 4 / 2**20:.1f} MiB)" in s.time_source
    m = tiny.model
    assert (m.name, m.family, m.num_layers, m.vocab_size, m.hidden_size) == (
        "tiny-llama", "llama", 4, 512, 64)
    for b in tiny.blocks:
        assert set(TIMES) <= set(b.measured) and "activation_bytes" in b.measured


def test_json_round_trip(tiny, tmp_path):
    path = tmp_path / "p.json"
    tiny.save(path)
    assert Profile.load(path) == tiny


# --- reuse ---------------------------------------------------------------------------------------


def test_the_glue_between_blocks_is_timed(tiny):
    """Masks and rotary tables run outside the blocks: a positive time, below the blocks'."""
    assert 0 < tiny.setup.glue_fwd_ms < sum(b.fwd_ms for b in tiny.blocks)
    assert len(tiny.setup.load_average) == 2


def test_blocks_run_outside_the_glue_s_torch_function_mode():
    """The model's code runs under ``KeepOffMeta``; the blocks the profiler times do not,
    as the runtime's do not (the mode cost a fifth of a small model's forward)."""
    from autopart.intake import discover_blocks
    from autopart.intake.forward import KeepOffMeta
    from autopart.profile.runner import ForwardRunner

    model = load_model("tiny-llama").model
    chain = discover_blocks(model)
    runner = ForwardRunner(model, chain, torch.device("cpu"), torch.float32, 1, 8)
    modes = []

    def visit(idx, module, args, kwargs):  # every call answered by a hidden-sized tensor
        modes.append(torch.overrides._get_current_function_mode())
        return torch.zeros(1, 8, model.config.hidden_size) if idx == 0 else args[0]

    runner.run(visit)
    assert len(modes) == len(chain.call_fqns)
    assert not any(isinstance(m, KeepOffMeta) for m in modes)


def test_what_a_stage_runs_outside_its_blocks_is_timed_by_position(tiny):
    """Glue after each block, the stand-in of each block, and for the output projections
    (a split half's C) the walk of the half's code on meta up to them: only there."""
    blocks = tiny.blocks
    assert 0 < sum(b.glue_after_ms for b in blocks) <= tiny.setup.glue_fwd_ms
    assert all(b.stand_in_ms > 0 for b in blocks)
    walks = [b.name for b in blocks if b.walk_ms > 0]
    assert walks == [f"model.layers.{i}.{p}" for i in range(4)
                     for p in ("self_attn.o_proj", "mlp.down_proj")]
    # the layer level: a layer's glue and stand-ins add up, and no layer starts inside a call
    layers = coarsen(tiny, "layer").blocks
    assert layers[1].stand_in_ms == pytest.approx(sum(b.stand_in_ms for b in blocks[1:5]))
    assert layers[1].glue_after_ms == pytest.approx(sum(b.glue_after_ms for b in blocks[1:5]))
    assert all(b.walk_ms == 0 for b in layers)


def test_identical_layers_are_measured_once(tiny):
    """Each layer's pieces are reused from layer 0's, so the fused layers are too."""
    assert [b.reused_from for b in tiny.blocks[5:9]] == [b.name for b in tiny.blocks[1:5]]
    layers = [b for b in coarsen(tiny, "layer").blocks if b.kind == "decoder_layer"]
    assert layers[0].reused_from is None
    assert all(b.reused_from == "model.layers.0" for b in layers[1:])
    assert all(b.fwd_ms == layers[0].fwd_ms for b in layers)
    assert tiny.blocks[0].reused_from is None and tiny.blocks[-1].reused_from is None


def test_identical_sequential_blocks_are_reused(steady_machine):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2))
    profile = profile_model(model, **FAST)
    # block 0 takes the model input, which needs no gradient, so its backward is
    # cheaper than its twins': it is measured on its own and 2, 3 reuse block 1
    assert [b.reused_from for b in profile.blocks] == [None, None, "1", "1", None]


def test_progress_reports_every_block():
    calls = []
    profile_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                  progress=lambda *a: calls.append(a), **FAST)
    assert calls == [(1, 2, "0"), (2, 2, "1")]


# --- generic chains ------------------------------------------------------------------------------


def test_sequential_starting_with_an_embedding_gets_token_ids():
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    profile = profile_model(model, micro_batch_size=2, **FAST)
    first = profile.blocks[0]
    assert first.bwd_input_ms == 0.0 and first.output_bytes == 2 * 16 * 8 * 4
    assert profile.model.family == "sequential"


def test_example_input_hook_is_used():
    class Net(nn.Sequential):
        def autopart_example_input(self, micro_batch_size: int, seq_len: int) -> torch.Tensor:
            return torch.randn(micro_batch_size, 3, 5)

    profile = profile_model(Net(nn.Linear(5, 6), nn.Linear(6, 2)), **FAST)
    assert profile.blocks[0].output_bytes == 1 * 3 * 6 * 4


def test_modulelist_model_is_profiled_through_its_forward():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))  # residual outside the layers
            return self.out(h)

    profile = profile_model(Net(), **FAST)
    assert [b.name for b in profile.blocks] == ["inp", "layers.0", "layers.1", "layers.2", "out"]
    assert profile.blocks[-1].output_bytes == 4  # the documented loss output.float().pow(2).mean()


class _Extend(nn.Module):
    """Returns the hidden states it is handed untouched on text alone (its output is its
    input): Phi-4-multimodal's feature embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor,
                pixels: torch.Tensor | None = None) -> torch.Tensor:
        if pixels is not None:
            return embeds + self.image(pixels)
        return embeds


class _Extended(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.extend = _Extend()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def autopart_example_input(self, micro_batch_size: int, seq_len: int) -> torch.Tensor:
        return torch.randint(0, 32, (micro_batch_size, seq_len))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.extend(ids, self.embed(ids))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def test_a_block_returning_its_input_untouched_is_timed_every_round():
    profile = profile_model(_Extended(), granularity="layer", **FAST)
    blocks = {b.name: b for b in profile.blocks}
    assert list(blocks) == ["embed", "extend", "layers.0", "layers.1"]
    # torch's B detaches its outputs in place; the output here is the block's input, which
    # every later round still differentiates: each round times a backward
    assert blocks["extend"].bwd_ms > 0 and blocks["extend"].bwd_input_ms > 0
    assert blocks["extend"].activation_bytes == 0


def test_meta_factory_model_is_materialized_per_block():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    profile = profile_model(model, **FAST)
    assert all(b.fwd_ms > 0 for b in profile.blocks)
    assert all(p.is_meta for p in model.parameters())


# --- the user's model is left alone --------------------------------------------------------------


def test_profiling_does_not_change_the_model(steady_machine):
    from transformers import AutoModelForCausalLM

    config = load_model("tiny-llama").config
    model = AutoModelForCausalLM.from_config(config)  # real CPU weights
    model.eval()
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    profile = profile_model(model, granularity="layer", **FAST)
    assert len(profile.blocks) == 7
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert not any(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    # the frozen weight makes layer 1 differ from layer 0: measured on its own
    assert profile.blocks[2].reused_from is None
    assert profile.blocks[3].reused_from == "model.layers.0"


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtype": "float64"}, "unsupported dtype 'float64'"),
    ({"backend": "tpu"}, "unknown backend 'tpu'"),
    ({"backend": "analytical"}, "needs a device"),
    ({"backend": "analytical:nope"}, "unknown device 'nope'.*h100"),
    ({"micro_batch_size": 0}, "micro_batch_size must be an integer >= 1, got 0"),
    ({"seq_len": 4096}, "seq_len 4096 exceeds tiny-llama's max_position_embeddings \\(512\\)"),
    ({"seq_len": 1}, "too short"),
    ({"num_repeats": 0}, "num_repeats must be an integer >= 1"),
    ({"num_warmup": -1}, "num_warmup must be an integer >= 0"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ProfileError, match=match):
        profile_model("tiny-llama", **{**FAST, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu():
    with pytest.raises(ProfileError, match="needs a CUDA GPU.*analytical:h100"):
        profile_model("tiny-llama", backend="cuda", **FAST)


def test_xla_without_torch_xla():
    pytest.importorskip("torch", reason="always")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        with pytest.raises(ProfileError, match=r"install autopart\[xla\]"):
            profile_model("tiny-llama", backend="xla", **FAST)
    else:  # pragma: no cover - only where torch_xla is installed
        pytest.skip("torch_xla is installed")


class _FailsOnRealData(nn.Linear):
    """Runs on meta (so the watched forward passes) but raises on real tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:
            raise RuntimeError("kaboom in user code")
        return super().forward(x)


def test_block_failure_is_one_clear_line():
    model = nn.Sequential(nn.Linear(4, 4), _FailsOnRealData(4, 4))
    with pytest.raises(ProfileError, match=r"block 1 \(_FailsOnRealData\) failed on backend cpu "
                                           r"in float32: RuntimeError: kaboom in user code"):
        profile_model(model, **FAST)


def test_half_precision_dtypes_run_on_cpu():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for dtype in ("bfloat16", "float16"):
        profile = profile_model(model, dtype=dtype, **FAST)
        assert profile.blocks[0].param_bytes == (8 * 8 + 8) * 2


def test_tied_head_counts_its_weight_but_the_model_counts_it_once():
    profile = profile_model("tiny-llama-tied", **FAST)
    assert profile.model.tied_embeddings
    embed, head = profile.blocks[0], profile.blocks[-1]
    assert embed.num_params == head.num_params == 512 * 64  # each stage holds its own copy
    assert profile.model.num_params == sum(b.num_params for b in profile.blocks) - 512 * 64


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("softcap", [30.0, None])
def test_what_the_model_code_saves_after_a_block_is_held_with_it(tmp_path, monkeypatch, softcap):
    """Gemma2 soft-caps its logits after the head (``tanh``, in the model's code, not in
    any block): a stage holding the head keeps that tanh's output per microbatch. The
    head's activations count it (one float32 logit tensor, 1 x 16 x 256 x 4 bytes) on top
    of what the head and loss save; without soft-capping nothing is added."""
    from transformers import AutoConfig

    hold_steady(monkeypatch)
    config = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, vocab_size=256,
                                  sliding_window=8, final_logit_softcapping=softcap)
    config.save_pretrained(tmp_path)
    profile = profile_model(str(tmp_path / "config.json"), cache_flush="model",
                            neighbours=0, **FAST)
    head = profile.blocks[-1]
    logits = 1 * 16 * 256 * 4
    if softcap:
        assert head.activation_bytes >= 2 * logits
        assert head.glue_saved_bytes == logits
    else:
        assert head.activation_bytes < 2 * logits
        assert head.glue_saved_bytes == 0
    # cut into shards, each slice repeats the soft-cap and holds its rows' share of it
    # (a tiny Gemma 2 with a 32k head split on 2 ranks: both ranks' memory read 10-18%
    # above the plan before, by one tanh output of their rows per microbatch in flight)
    from autopart.levels import split_head

    shards = split_head(profile, 4).blocks[-4:]
    positions = 1 * 15 * 256 * 4  # the sliced loss's log-softmax, over the shifted labels
    assert sum(b.activation_bytes for b in shards) == positions + head.glue_saved_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_config_asking_for_the_router_loss_profiles(tmp_path, monkeypatch, model_type):
    """``output_router_logits=True`` (a config set up to train with the MoE router's loss):
    the glue is timed with the block calls answered by recorded outputs, which record no
    router logits; HF's loss then failed on the empty tuple. The profile is made with the
    model's own router loss off, as a stage runs (``autopart.runtime.aux_loss`` adds it),
    and the config is left as it was."""
    from families import tiny_config

    hold_steady(monkeypatch)
    config = tiny_config(model_type, output_router_logits=True, router_aux_loss_coef=0.01)
    config.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path / "config.json"))
    profile = profile_model(loaded, granularity="layer", neighbours=0, **FAST)
    assert loaded.model.config.output_router_logits and profile.model.router_loss_pass
    assert [b.kind for b in profile.blocks].count("decoder_layer") == config.num_hidden_layers
    assert any("router auxiliary loss" in note for note in profile.model.notes)
