"""experts.down_fit "replica" (hexq.calib.quantize.fill_bank): each width's down projection fitted to the
intermediate that the same width's gate_up replica produces, instead of to the full-precision one.

With one Hessian for every width (002 Alg. 1) a replica's down projection is quantized as if its input were the
full-precision intermediate m = act(x W_g) * (x W_u), but it receives q_b = act(x Q_g,b) * (x Q_u,b), which at 1-2 bits
is far from m. The down projection at width b is instead aimed at the output the expert must reproduce, W_d m, from
the input it gets, q_b (the asymmetric target of GPTAQ), with a ridge towards per-channel gains:

    min_V sum_t ||W_d m_t - V q_t||^2 + lambda ||V - W_d D||^2  =>  V_b = W_d (C_b + lambda D) (H_b + lambda I)^-1,

C_b = sum_t m_t q_t^T, H_b = sum_t q_t q_t^T, D = diag(C_b) / diag(H_b) (each channel's least-squares gain from q_b
to m), lambda = (in / tokens) mean diag H_b. The pure least-squares map (a ridge towards 0) over-fits an expert's
in x in values on few tokens; pulled towards W_d D it needs only `in` gains where tokens are few and becomes the
least-squares map as they grow. Then GPTQ of V_b on H_b, and each output row's gain refitted (output_scale). What it
gains, at what cost: docs/packing-and-export.md "Below 3 bits".

Cold experts (fewer than experts.min_tokens routed tokens) keep the full-precision target and Hessian."""

from __future__ import annotations

import torch

from hexq.calib.capture import TOKEN_CHUNK
from hexq.model.simulate import RoutedTokens, expert_intermediate

# Widths from here up keep one Hessian: the fit is for the low widths (the reference models' allocations at 1.5-2.5
# bits hold no 8-bit expert, at 3.0 one or two), and fitting 8 bits too costs a fifth more of it (a real-shaped
# layer: 1.53x the calibration time with every width fitted, 1.39x without the 8-bit one).
FIT_BELOW = 8


def replica_intermediates(x: torch.Tensor, gate_ups: torch.Tensor, act_fn) -> torch.Tensor:
    """The down projection's inputs [B, n, I] of x [n, H] through B gate_up replicas [B, 2I, H] at once."""
    gate, up = torch.matmul(x, gate_ups.transpose(1, 2)).chunk(2, dim=-1)
    return act_fn(gate) * up


def fitted_map(weight: torch.Tensor, cross: torch.Tensor, hessian: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The down projection V [..., out, in] that best maps the replica's intermediate to the full-precision output, for
    a batch of weights W [..., out, in], cross-products C and Hessians H [..., in, in] summed over `tokens` [...]
    routed tokens: V = (W C + lambda W D) (H + lambda I)^-1, the least-squares map with a ridge towards W D, D the
    per-channel gains diag(C) / diag(H) (in parameters where the map has out x in), lambda = (in / tokens) mean diag H.
    The in x in map M = (C + lambda D)(H + lambda I)^-1 in solve_dtype's dtype, then V = W M in W's dtype."""
    dtype = solve_dtype(hessian, tokens)
    h = hessian.to(dtype, copy=True)  # becomes H + lambda I
    rhs_t = cross.to(dtype).mT.clone(memory_format=torch.contiguous_format)  # becomes (C + lambda D)^T
    h_diagonal, c_diagonal = torch.diagonal(h, dim1=-2, dim2=-1), torch.diagonal(rhs_t, dim1=-2, dim2=-1)
    gains = torch.where(h_diagonal > 0, c_diagonal / h_diagonal.clamp_min(torch.finfo(dtype).tiny), 1.0)
    ridge = h.shape[-1] / tokens.to(dtype).clamp_min(1) * h_diagonal.mean(dim=-1)
    ridge = torch.where(ridge > 0, ridge, 1.0)  # H = C = 0 (no signal): any ridge gives V = W D = W
    c_diagonal.add_(ridge[..., None] * gains)
    h_diagonal.add_(ridge[..., None])
    # M^T = (H + lambda I)^-1 (C + lambda D)^T, H + lambda I symmetric positive definite: a Cholesky solve
    mapping = torch.cholesky_solve(rhs_t, torch.linalg.cholesky(h)).transpose(-2, -1)
    return weight @ mapping.to(weight.dtype)


# H + lambda I has condition number at most tokens + 1 (H's eigenvalues are positive and sum to in x mean diag H, which
# is tokens x lambda), so a float32 solve (the statistics are float32) is accurate to about tokens x 1.2e-7, and that
# only in the directions H weighs least. Up to this many tokens it runs in float32, in 0.63x float64's time (12 experts'
# maps at 768 inputs; a real-shaped layer's 512: 11 s of Cholesky and solve in float64); a chunk holding an expert
# routed more tokens (the hot experts: a Qwen3-30B-A3B-shaped layer at 128 windows routes up to ~5,800) solves in
# float64.
FLOAT32_TOKENS = 4096


def solve_dtype(hessian: torch.Tensor, tokens: torch.Tensor) -> torch.dtype:
    """The dtype of fitted_map's solve for Hessians summed over `tokens` routed tokens each: float64 for float64
    statistics or beyond FLOAT32_TOKENS tokens, else float32."""
    return torch.float64 if hessian.dtype == torch.float64 or int(tokens.max()) > FLOAT32_TOKENS else torch.float32


def output_scale(weight: torch.Tensor, quantized: torch.Tensor, cross: torch.Tensor,
                 hessian: torch.Tensor) -> torch.Tensor:
    """Per output channel r, the factor a_r minimising sum_t ((W m_t)_r - a_r (Q q_t)_r)^2, from the statistics alone:
    a = diag(W C Q^T) / diag(Q H Q^T) for weights W and Q [..., out, in], C and H [..., in, in]; 1 where Q's output is
    zero. The map is fitted before GPTQ rounds it; refitting each row's gain after rounding takes back part of the
    rounding error (on the reference models' layers it lowered the replicas' output error at every width). Folded
    into the row's group scales the factor is exact: (c - z) s a."""
    energy = ((quantized @ hessian.to(quantized.dtype)) * quantized).sum(dim=-1)
    aligned = ((weight @ cross.to(weight.dtype)) * quantized).sum(dim=-1)
    scale = aligned / energy.clamp_min(torch.finfo(energy.dtype).tiny)
    return torch.where(energy > 0, scale, torch.ones_like(scale))


def replica_statistics(routed: RoutedTokens, experts: list[int], warm: list[int], gate_up: torch.Tensor,
                       replica_gate_ups: torch.Tensor, act_fn,
                       weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H [B, n, I, I], C [B, n, I, I], tokens [n]) of the chunk's experts (gate_up [n, 2I, H] full precision,
    replica_gate_ups [B, n, 2I, H] the B widths' replicas) on every routed token, like the GPTQ Hessians (not the
    loss table's sample of experts.loss_tokens: the map has in x in values to fit, and on the reference models at 128
    windows fitting it on every token instead of 2048 lowered the low-bit cells' mean KL divergence by a median 3%
    (Qwen3-MoE) and 14% (Mixtral), docs/packing-and-export.md "More routed tokens per expert"), for the `warm`
    positions j of `experts` (zeros elsewhere): H = sum_t q_t q_t^T and C = sum_t m_t q_t^T with m the full-precision
    intermediate and q each replica's. Every width of an expert in one product: the loop runs over experts and token
    chunks only. weighted (experts.token_weights "routing"): each token's terms weighted by its squared routing weight
    (RoutedTokens.scales), as the loss table weighs it."""
    widths, n, inner = replica_gate_ups.shape[0], len(experts), gate_up.shape[1] // 2
    hessian = torch.zeros(widths, n, inner, inner, dtype=torch.float32, device=gate_up.device)
    cross = torch.zeros_like(hessian)
    tokens = torch.zeros(n, dtype=torch.long, device=gate_up.device)
    for j in warm:
        token, slot = routed.rows(experts[j])
        tokens[j] = token.shape[0]
        scales = routed.scales(token, slot) if weighted else None
        for start in range(0, len(token), TOKEN_CHUNK):
            x = routed.x[token[start:start + TOKEN_CHUNK]].float()
            full = expert_intermediate(x, gate_up[j], act_fn).float()
            got = replica_intermediates(x, replica_gate_ups[:, j], act_fn)
            if scales is not None:
                scale = scales[start:start + TOKEN_CHUNK, None]
                full, got = full * scale, got * scale
            hessian[:, j] += got.transpose(1, 2) @ got
            cross[:, j] += full.T @ got
    return hessian, cross, tokens
