"""The attention every streamed model runs: transformers' SDPA, except that a grouped-query attention with a mask on
the CPU is given to torch's fused kernel with its key-value heads as they are.

Why. transformers' SDPA passes `enable_gqa` only without a mask; with one (every prefill pass after the first, whose
queries follow cached positions) it first repeats each key-value head for its query heads: on a Qwen3-30B-A3B shape
(32 query heads, 4 key-value heads, 128 wide) at 4,096 positions that is 64 MiB of keys and values per layer, the
largest allocation of a prefill pass. On the CPU torch's fused (flash) kernel takes the boolean mask transformers
builds and the grouped heads together, in blocks of queries and positions, so no [heads, tokens, positions] scores
and no repeated heads exist; the outputs are the same bits (tests/test_prefill_memory.py), and it is faster (256
queries at 4,096 positions, AMD EPYC, 2 threads: 115 against 146 ms). The memory plan counts on it
(hexq.runtime.memory.prefill_scratch_nbytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "hexq_sdpa"


def fused_on(device: torch.device, key_dim: int, value_dim: int) -> bool:
    """Whether a masked attention on `device` runs in torch's fused kernel without repeated heads: on the CPU,
    when keys and values are as wide (deepseek's MLA, 192-wide keys and 128-wide values, takes the unfused path)."""
    return device.type == "cpu" and key_dim == value_dim


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface ([batch, heads, tokens, dim] queries, [batch, KV heads, positions, dim]
    keys and values, output [batch, tokens, heads, dim]); see the module docstring."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if attention_mask is None or not grouped or kwargs.get("position_bias") is not None \
            or not fused_on(query.device, key.shape[-1], value.shape[-1]) or query.shape[-1] != key.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
