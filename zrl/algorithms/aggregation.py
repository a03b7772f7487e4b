"""Loss aggregation over tokens and sequences, exact under microbatching and data parallelism.

Responsibility: reduce the per-token losses of ONE microbatch to the scalar that this microbatch
contributes to the global-batch loss. Every mode is a sum of per-token terms divided by constants of
the global batch, so the sum of these scalars over all gradient-accumulation steps and all
data-parallel ranks equals the formula over the global batch (docs/algorithms.md §4; ZAYA1-8B report
§IV-B1, Dr-GRPO):

- "seq_mean_token_sum_norm" (Dr-GRPO, the ZAYA1 default):
      L = (1/N_seq) Σ_i Σ_t l_{i,t} / T_norm,  T_norm = max_response_tokens (a constant).
- "token_mean":            L = Σ_i Σ_t l_{i,t} / N_tok.
- "seq_mean_token_mean":   L = (1/N_seq) Σ_i (Σ_t l_{i,t} / T_i),  T_i = loss tokens of rollout i.

N_seq and N_tok are GLOBAL counts (all microbatches of the step on all ranks), passed in by the
trainer, which sums `local_counts` over its microbatches and all-reduces. With data-parallel gradient
averaging (FSDP2 divides by the world size) multiply by the world size, or sum gradients instead.

Layout: packed token streams `[T]` with `seq_idx [T]` (int, the rollout each token belongs to, any
ids unique within the microbatch), or padded `[B, S]` with `seq_idx=None` (row = rollout).
Invariants: a rollout never spans microbatches (needed by seq_mean_token_mean's T_i); loss-mask-false
tokens contribute exactly 0; a rollout with no loss tokens (empty response) still counts in N_seq.
Global counts of 0 give a zero loss that is still connected to the graph, so every rank can run
backward (FSDP2 needs all ranks in the collective).
"""

from __future__ import annotations

from typing import Literal

import torch

AggregationName = Literal["seq_mean_token_sum_norm", "token_mean", "seq_mean_token_mean"]
AGGREGATION_NAMES: tuple[str, ...] = ("seq_mean_token_sum_norm", "token_mean", "seq_mean_token_mean")


def _flatten(token_loss: torch.Tensor, loss_mask: torch.Tensor,
             seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if loss_mask.shape != token_loss.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token_loss {tuple(token_loss.shape)}")
    if seq_idx is None:
        if token_loss.dim() != 2:
            raise ValueError("seq_idx is required unless token_loss is padded [B, S] (rows are rollouts)")
        b, l = token_loss.shape
        seq_idx = torch.arange(b, device=token_loss.device).repeat_interleave(l)
    elif token_loss.dim() != 1 or seq_idx.shape != token_loss.shape:
        raise ValueError(f"packed layout needs token_loss [T] and seq_idx [T], got "
                         f"{tuple(token_loss.shape)} and {tuple(seq_idx.shape)}")
    return token_loss.reshape(-1), loss_mask.reshape(-1).to(torch.bool), seq_idx.reshape(-1).long()


def _masked_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where (not multiply) so that non-finite padding losses do not turn the sum into NaN.
    return torch.where(mask, token_loss, torch.zeros_like(token_loss)).sum()


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def local_counts(loss_mask: torch.Tensor, seq_idx: torch.Tensor | None = None) -> tuple[int, int]:
    """(rollouts, loss tokens) in this microbatch; sum them over microbatches and ranks for the globals.

    Rollouts are the distinct ids in seq_idx (rows for padded [B, S]), whether or not they have loss
    tokens.
    """
    if seq_idx is None:
        if loss_mask.dim() != 2:
            raise ValueError("seq_idx is required unless loss_mask is padded [B, S]")
        num_seqs = loss_mask.shape[0]
    else:
        num_seqs = int(torch.unique(seq_idx).numel())
    return num_seqs, int(loss_mask.to(torch.bool).sum())


def seq_mean_token_sum_norm(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, global_num_seqs: int,
                            max_response_tokens: int) -> torch.Tensor:
    """This microbatch's share of (1/N_seq) Σ_i Σ_t l_{i,t} / T_norm (Dr-GRPO)."""
    if loss_mask.shape != token_loss.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token_loss {tuple(token_loss.shape)}")
    _check_count("global_num_seqs", global_num_seqs)
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
    total = _masked_sum(token_loss, loss_mask.to(torch.bool))
    if global_num_seqs == 0:
        return total * 0.0
    return total / (float(global_num_seqs) * float(max_response_tokens))


def token_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, global_num_tokens: int) -> torch.Tensor:
    """This microbatch's share of Σ l / N_tok over all loss tokens of the global batch."""
    if loss_mask.shape != token_loss.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token_loss {tuple(token_loss.shape)}")
    _check_count("global_num_tokens", global_num_tokens)
    total = _masked_sum(token_loss, loss_mask.to(torch.bool))
    if global_num_tokens == 0:
        return total * 0.0
    return total / float(global_num_tokens)


def seq_mean_token_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor, seq_idx: torch.Tensor | None, *,
                        global_num_seqs: int) -> torch.Tensor:
    """This microbatch's share of (1/N_seq) Σ_i mean_t l_{i,t} (rollouts lie wholly in the microbatch)."""
    _check_count("global_num_seqs", global_num_seqs)
    loss, mask, seq = _flatten(token_loss, loss_mask, seq_idx)
    if loss.numel() == 0 or global_num_seqs == 0:
        return _masked_sum(loss, mask) * 0.0
    denom = _rollout_token_counts(seq, mask).clamp(min=1.0).to(loss.dtype)
    return _masked_sum(loss / denom, mask) / float(global_num_seqs)


def _rollout_token_counts(seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per token, T_i: the masked tokens of its rollout (float64 [T]). The rollout ids (sparse global ids)
    are compacted by a sort and a running count, not by `unique`/`bincount`, whose output sizes a GPU must
    send back to the host: no host synchronisation."""
    order = torch.sort(seq, stable=True).indices
    ordered = seq[order]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    local = torch.empty_like(seq)
    local[order] = torch.cumsum(starts.long(), 0) - 1  # 0..N-1, N <= T rollouts
    counts = torch.zeros(seq.numel(), dtype=torch.float64, device=seq.device)
    return counts.scatter_add_(0, local, mask.to(torch.float64))[local]


def token_weights(name: AggregationName | str, loss_mask: torch.Tensor, seq_idx: torch.Tensor | None = None, *,
                  global_num_seqs: int, global_num_tokens: int, max_response_tokens: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [T] (or [B, S]) with `aggregate_loss(name, l, ...)` = sum_t w_t l_t: every mode is a sum of per-token
    terms over constants of the batch, so a fused LM head can form d loss / d l_t = w_t per token. 0 where
    the loss mask is false. Costs what `aggregate_loss` costs (seq_mean_token_mean counts T_i per rollout)."""
    mask = loss_mask.to(torch.bool)
    zero = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if name == "seq_mean_token_sum_norm":
        _check_count("global_num_seqs", global_num_seqs)
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        if global_num_seqs == 0:
            return zero
        return torch.where(mask, 1.0 / (float(global_num_seqs) * float(max_response_tokens)), zero)
    if name == "token_mean":
        _check_count("global_num_tokens", global_num_tokens)
        return zero if global_num_tokens == 0 else torch.where(mask, 1.0 / float(global_num_tokens), zero)
    if name == "seq_mean_token_mean":
        _check_count("global_num_seqs", global_num_seqs)
        _, flat_mask, seq = _flatten(zero, mask, seq_idx)
        if flat_mask.numel() == 0 or global_num_seqs == 0:
            return zero
        denom = _rollout_token_counts(seq, flat_mask).clamp(min=1.0).to(dtype)  # T_i of each token's rollout
        return torch.where(flat_mask, 1.0 / denom / float(global_num_seqs), 0.0).to(dtype).reshape(mask.shape)
    raise ValueError(f"unknown loss aggregation {name!r}; valid: {list(AGGREGATION_NAMES)}")


def aggregate_loss(name: AggregationName | str, token_loss: torch.Tensor, loss_mask: torch.Tensor,
                   seq_idx: torch.Tensor | None = None, *, global_num_seqs: int, global_num_tokens: int,
                   max_response_tokens: int) -> torch.Tensor:
    """This microbatch's loss term for aggregation mode `name` (the recipe's `loss_aggregation`)."""
    if name == "seq_mean_token_sum_norm":
        return seq_mean_token_sum_norm(token_loss, loss_mask, global_num_seqs=global_num_seqs,
                                       max_response_tokens=max_response_tokens)
    if name == "token_mean":
        return token_mean(token_loss, loss_mask, global_num_tokens=global_num_tokens)
    if name == "seq_mean_token_mean":
        return seq_mean_token_mean(token_loss, loss_mask, seq_idx, global_num_seqs=global_num_seqs)
    raise ValueError(f"unknown loss aggregation {name!r}; valid: {list(AGGREGATION_NAMES)}")
