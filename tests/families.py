"""Tiny configs of every decoder-only HF family autopart serves (built on meta, no hub)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

_COMMON = {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 64,
           "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0,
           "pad_token_id": 0}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "mistral": {"sliding_window": 6},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 6},
    "gemma3_text": {"head_dim": 8, "sliding_window": 6, "sliding_window_pattern": 2},
    "phi3": {},
    "olmo2": {},
    "gpt2": {"n_embd": 32, "n_head": 4, "n_layer": 4, "n_positions": 64, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {},
    "falcon": {"new_decoder_architecture": False, "hidden_dropout": 0.0,
               "attention_dropout": 0.0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "head_dim": 8},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_shared_experts": 1,
                    "num_key_value_heads": 4},
}
MORE_FAMILIES: dict[str, dict[str, Any]] = {
    "bloom": {"n_layer": 4, "n_head": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0,
            "attention_dropout": 0.0},
    "gpt_bigcode": {"n_embd": 32, "n_head": 4, "n_layer": 4, "n_positions": 64,
                    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "starcoder2": {"residual_dropout": 0.0, "embedding_dropout": 0.0},
    "mamba": {"state_size": 4, "expand": 2, "conv_kernel": 2},
    "cohere": {},
}
"""Families beyond the issue's list, also served by watching the forward."""
CURRENT_FAMILIES: dict[str, dict[str, Any]] = {
    # attention sinks, alternating sliding / full attention, MoE with biased experts
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                "sliding_window": 6, "intermediate_size": 32},
    # chunked attention (iRoPE: rope-less layers), MoE with a shared expert, QK norm
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 8,
                    "intermediate_size_mlp": 64, "attention_chunk_size": 6,
                    "no_rope_layer_interval": 2},
    # hybrid gated delta-net linear attention (conv state) and full attention, MoE
    "qwen3_next": {"head_dim": 8, "linear_conv_kernel_dim": 2, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                   "full_attention_interval": 2},
    # the same hybrid linear attention, dense MLP
    "qwen3_5_text": {"head_dim": 8, "linear_conv_kernel_dim": 2, "linear_key_head_dim": 8,
                     "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "full_attention_interval": 2},
    # multi-head latent attention (MLA), MoE with shared experts
    "deepseek_v2": {"n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_shared_experts": 1,
                    "num_key_value_heads": 4, "head_dim": 8},
}
"""Families people train now (issue 21): sinks, hybrid linear attention, MLA, chunked."""
FAMILIES_ALL = {**FAMILIES, **MORE_FAMILIES, **CURRENT_FAMILIES}

_ONLY = {"gpt2": ("vocab_size", "bos_token_id", "eos_token_id"),
         "gpt_bigcode": ("vocab_size", "bos_token_id", "eos_token_id"),
         "bloom": ("vocab_size", "hidden_size", "bos_token_id", "eos_token_id",
                   "pad_token_id"),
         "mamba": ("vocab_size", "hidden_size", "num_hidden_layers", "bos_token_id",
                   "eos_token_id", "pad_token_id"),
         "falcon": ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                    "bos_token_id", "eos_token_id")}


def tiny_config(model_type: str, **overrides: Any):
    """An ``AutoConfig`` of ``model_type`` a few thousand parameters large."""
    from transformers import AutoConfig

    keys = _ONLY.get(model_type)
    base = {k: v for k, v in _COMMON.items() if keys is None or k in keys}
    base.update(FAMILIES_ALL[model_type])
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def real_model(config) -> nn.Module:
    """The unpipelined reference: the same model with real, seeded weights on the CPU."""
    from autopart.intake.sources import build_hf_model

    model = build_hf_model(config)
    torch.manual_seed(0)
    return init_real(model)


def init_real(model: nn.Module) -> nn.Module:
    """Give an HF model built on meta real storage on the CPU and its own initialization
    (``autopart.intake.storage.init_hf_weights``: what ``_init_weights`` leaves unset gets
    a default, as on a pipeline rank)."""
    from autopart.intake.storage import empty_on, init_hf_weights

    empty_on(model, "cpu", fill=float("nan"))
    with torch.no_grad():
        init_hf_weights(model, model)
    model.tie_weights()
    return model


class Reference(NamedTuple):
    """The unpipelined model's run that the exactness tests compare with."""

    state: dict[str, torch.Tensor]
    input_ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    loss: float
    grads: dict[str, torch.Tensor]


def reference_run(config) -> Reference:
    """``real_model(config)`` on a padded batch of 4 x 12: its weights, the batch, its loss
    and every parameter's gradient."""
    from runtime_helpers import padded_batch

    reference = real_model(config)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    input_ids, mask, labels = padded_batch(config.vocab_size, batch=4, seq_len=12)
    out = reference(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    return Reference(state, input_ids, mask, labels, out.loss.item(), grads)
