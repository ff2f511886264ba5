"""Intake: model sources on meta and block discovery, compared with hand-written expectations."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autopart._data import data_path
from autopart.errors import ModelSourceError
from autopart.intake import discover_blocks, list_presets, load_model

TINY_LLAMA = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
              "model.layers.3", "model.norm", "lm_head"]


def _all_meta(model: nn.Module) -> bool:
    """Every parameter is on meta (small buffers such as rotary tables stay real)."""
    return all(p.is_meta for p in model.parameters())


# --- sources -----------------------------------------------------------------------------------


def test_presets_include_the_documented_ones():
    assert {"tiny-llama", "tiny-qwen2", "tiny-llama-tied", "llama-3-70b"} <= set(list_presets())


def test_preset_builds_on_meta():
    loaded = load_model("tiny-llama")
    assert loaded.name == "tiny-llama" and loaded.source == "preset:tiny-llama"
    assert loaded.config.hidden_size == 64
    assert _all_meta(loaded.model)


def test_large_preset_allocates_nothing():
    loaded = load_model("llama-3-70b")
    assert _all_meta(loaded.model)
    assert sum(p.numel() for p in loaded.model.parameters()) > 70e9


def test_unknown_preset_names_the_presets():
    with pytest.raises(ModelSourceError, match="unknown model 'no-such-model'.*tiny-llama"):
        load_model("no-such-model")


@pytest.mark.parametrize("bad", ["", None, 3])
def test_non_string_source_is_rejected(bad):
    with pytest.raises(ModelSourceError, match="non-empty string or nn.Module"):
        load_model(bad)


def test_missing_config_path(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(str(tmp_path / "nowhere" / "config.json"))


def test_config_file_and_directory(tmp_path):
    preset = json.loads(Path(_preset_path("tiny-qwen2")).read_text())
    (tmp_path / "config.json").write_text(json.dumps(preset))
    from_dir = load_model(str(tmp_path))
    from_file = load_model(str(tmp_path / "config.json"))
    assert from_dir.config.model_type == from_file.config.model_type == "qwen2"
    assert _all_meta(from_dir.model)


def test_invalid_json_and_missing_model_type(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelSourceError, match="not valid JSON"):
        load_model(str(bad))
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelSourceError, match="no 'model_type'"):
        load_model(str(bad))


def test_hub_id_not_in_cache():
    with pytest.raises(ModelSourceError, match="not in the local HF cache"):
        load_model("autopart-test-org/definitely-not-cached-model")


@pytest.fixture()
def factories(tmp_path, monkeypatch):
    (tmp_path / "ap_factories.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def good():
            return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def raises():
            raise RuntimeError("boom in user code")

        def not_a_module():
            return 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ap_factories"
    sys.modules.pop("ap_factories", None)


def test_factory_builds_on_meta(factories):
    loaded = load_model(f"{factories}:good")
    assert loaded.name == "good" and _all_meta(loaded.model)


def test_factory_that_raises(factories):
    with pytest.raises(ModelSourceError, match="raised RuntimeError: boom in user code"):
        load_model(f"{factories}:raises")


def test_factory_errors(factories):
    with pytest.raises(ModelSourceError, match="returned int"):
        load_model(f"{factories}:not_a_module")
    with pytest.raises(ModelSourceError, match="cannot import factory"):
        load_model(f"{factories}:missing")
    with pytest.raises(ModelSourceError, match="cannot import factory"):
        load_model("no_such_module_xyz:fn")


def test_module_source_is_used_as_is():
    model = nn.Sequential(nn.Linear(2, 2))
    loaded = load_model(model)
    assert loaded.model is model and loaded.name == "Sequential"


# --- blocks ------------------------------------------------------------------------------------


def test_tiny_llama_blocks():
    chain = discover_blocks(load_model("tiny-llama").model)
    assert chain.names == TINY_LLAMA
    assert [b.kind for b in chain.blocks] == (["embedding"] + ["decoder_layer"] * 4
                                             + ["norm", "head"])
    assert chain.family == "hf_causal_lm" and not chain.tied_embeddings
    assert chain.layer_class_names == ("LlamaDecoderLayer",)
    assert chain.shared_modules == ("model.rotary_emb",)


def test_tiny_qwen2_blocks():
    loaded = load_model("tiny-qwen2")
    chain = discover_blocks(loaded.model)
    num = loaded.config.num_hidden_layers
    assert chain.names == (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(num)]
                           + ["model.norm", "lm_head"])
    assert chain.layer_class_names == ("Qwen2DecoderLayer",)


def test_tied_embeddings_detected():
    assert discover_blocks(load_model("tiny-llama-tied").model).tied_embeddings
    assert not discover_blocks(load_model("tiny-llama").model).tied_embeddings


def test_sequential_children_are_blocks():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    chain = discover_blocks(model)
    assert chain.names == ["0", "1", "2", "3"] and chain.family == "sequential"
    assert {b.kind for b in chain.blocks} == {"block"}


class ModuleListModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.body.layers:
            h = h + self.act(layer(h))
        return self.out(h)


def test_modulelist_model_blocks():
    chain = discover_blocks(ModuleListModel())
    assert chain.names == ["embed", "body.layers.0", "body.layers.1", "body.layers.2", "out"]
    assert chain.blocks[0].kind == "embedding" and chain.family == "traced"
    assert chain.layer_class_names == ("Linear",)


def test_layer_classes_override():
    chain = discover_blocks(ModuleListModel(), layer_classes=["Linear"])
    assert chain.names == ["embed", "body.layers.0", "body.layers.1", "body.layers.2", "out"]
    assert chain.layer_class_names == ("Linear",)
    # the ModuleList's container is then a block the forward never calls: one line
    with pytest.raises(ModelSourceError, match=r"parameter of shape \(8, 8\) outside"):
        discover_blocks(ModuleListModel(), layer_classes=["Embedding"])
    with pytest.raises(ModelSourceError, match="no module of class"):
        discover_blocks(ModuleListModel(), layer_classes=["Conv2d"])


def test_model_without_blocks():
    with pytest.raises(ModelSourceError, match="no ModuleList"):
        discover_blocks(nn.Linear(2, 2))


def test_fingerprint_is_stable_and_discriminating():
    a = discover_blocks(load_model("tiny-llama").model).fingerprint
    b = discover_blocks(load_model("tiny-llama").model).fingerprint
    assert a == b and len(a) == 16
    assert discover_blocks(load_model("tiny-llama-tied").model).fingerprint != a
    with torch.device("meta"):
        m1 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        m2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    assert discover_blocks(m1).fingerprint != discover_blocks(m2).fingerprint


def _preset_path(name: str) -> str:

    return str(data_path("presets", f"{name}.json"))


class _Branchy(nn.Module):
    """Decides in its forward, between layers, from a layer's output values."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.abs().max().item() > 1e9:
                break
        return x


def test_forward_branching_on_block_values_is_refused():
    with pytest.raises(ModelSourceError, match=r"reads the values .* \(Tensor\.item\)"):
        discover_blocks(_Branchy())


def test_reading_a_parameter_dtype_between_blocks_is_allowed():
    class Head(nn.Module):  # like Mamba's head: h.to(self.out.weight.dtype)
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.out(x.to(self.out.weight.dtype))

    assert discover_blocks(Head()).names == ["layers.0", "layers.1", "out"]


def _counting_substitute() -> type:
    """A ``Substitute`` that counts the torch calls it sees (on its class, fresh each call)."""
    from autopart.intake.forward import Substitute

    class Counting(Substitute):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    return Counting


def test_substitute_swaps_stand_ins_in_the_glue_and_not_inside_paused_blocks():
    """The mode replaces a stand-in by its received tensor in every torch call of the glue
    (also inside lists and dicts), looks at nothing else, and stays out of a block's own
    calls while paused (the runtime swaps a block's arguments itself)."""
    Counting = _counting_substitute()
    stand_in, received, other = torch.zeros(2), torch.ones(2), torch.full((2,), 3.0)
    mode = Counting()
    mode.add(stand_in, received)
    with mode:
        assert torch.equal(stand_in + other, torch.full((2,), 4.0))
        assert torch.equal(torch.cat([other, stand_in]), torch.tensor([3.0, 3.0, 1.0, 1.0]))
        assert torch.equal(torch.add(other, other=stand_in), torch.full((2,), 4.0))
        assert torch.equal(other * 2, torch.full((2,), 6.0))  # nothing to swap
        before = Counting.calls
        with mode.paused():
            assert torch.equal(stand_in + other, other)  # a block's own call: untouched
        assert Counting.calls == before
        assert torch.equal(stand_in + other, torch.full((2,), 4.0))  # back on after
    assert not mode._may_hold((other, 2), {"alpha": 1})
    assert mode._may_hold(([other, (stand_in,)],), {})
    assert mode._may_hold((), {"x": {"y": stand_in}})


def test_substitute_from_first_add_enters_the_mode_only_once_there_is_a_swap():
    """A stage's torch calls before its first received tensor (its stand-ins, the model's
    code up to its first block) run outside the mode; from the first ``add`` on the glue
    is swapped as before, and leaving restores the mode stack as it was."""
    from torch.overrides import _get_current_function_mode_stack

    Counting = _counting_substitute()
    stand_in, received, other = torch.zeros(2), torch.ones(2), torch.full((2,), 3.0)
    mode = Counting()
    outer = _get_current_function_mode_stack()
    with mode.from_first_add():
        assert torch.equal(stand_in + other, other)  # nothing received yet: not swapped
        assert Counting.calls == 0
        mode.add(stand_in, received)
        assert torch.equal(stand_in + other, torch.full((2,), 4.0))
        assert Counting.calls > 0
        mode.add(other, received)  # entered once
        assert _get_current_function_mode_stack() == [*outer, mode]
    assert _get_current_function_mode_stack() == outer
    with mode.from_first_add():  # never added to: never entered
        assert _get_current_function_mode_stack() == outer
    assert torch.equal(stand_in + other, torch.full((2,), 3.0))
