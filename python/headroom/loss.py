"""The loss lever in your own loop: the LM head and the cross-entropy over chunks of tokens.

``chunked_cross_entropy(hidden, weight, labels)`` is what ``F.cross_entropy(lm_head(hidden).float(),
labels)`` computes, without ever holding the whole ``[tokens, vocab]`` logits: forward keeps one
float32 log-sum-exp per token, and backward recomputes each chunk's logits from the hidden states
(the choice headroom's trainer makes for ``--loss chunked``: the gradient comes from the loss's real
incoming gradient, and nothing the size of the head's gradient is held from forward to backward).

The numbers are the full path's: the logits are rounded to the matmul's dtype (autocast's, else the
hidden states') and upcast to float32 for the softmax; the softmax's gradient is rounded to that
dtype before the matmuls, as the full path's cast does; the head's gradient is summed over the
chunks in float32 and rounded once.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["chunked_cross_entropy", "default_chunk"]


def default_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: tokens / ceil(vocab / hidden) to the nearest power of two, within
    [256, tokens] (a chunk's logits about the size of the hidden states, but no chunk so small that
    streaming the head for it dominates), as ``--loss chunked``."""
    tokens = max(tokens, 1)
    ratio = -(-max(vocab, 1) // max(hidden, 1))
    target = max(1, tokens // ratio)
    p = 1
    while p * 2 <= target:
        p *= 2
    if target - p > p * 2 - target:
        p *= 2
    return min(max(p, 256), tokens)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index):
        compute = _compute_dtype(hidden)
        device = hidden.device.type
        with torch.autocast(device, enabled=False):
            hc = hidden.to(compute)
            wc = weight.to(compute)
            n = hc.shape[0]
            valid = labels != ignore_index
            count = valid.sum()
            safe = labels.masked_fill(~valid, 0)
            lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                lf = (hc[s:e] @ wc.t()).float()
                picked = lf.gather(1, safe[s:e].unsqueeze(1))
                top = lf.amax(1, keepdim=True)
                lf.sub_(top).exp_()
                chunk_lse = lf.sum(1, keepdim=True)
                del lf
                chunk_lse.log_().add_(top)
                lse[s:e] = chunk_lse.squeeze(1)
                total += ((chunk_lse - picked).squeeze(1) * valid[s:e]).sum()
            del wc
        ctx.save_for_backward(hc, weight, safe, valid, lse, count)
        ctx.hidden_dtype = hidden.dtype
        ctx.chunk = chunk
        return total / count.clamp_min(1)

    @staticmethod
    def backward(ctx, grad):
        hc, weight, safe, valid, lse, count = ctx.saved_tensors
        compute = hc.dtype
        chunk = ctx.chunk
        n = hc.shape[0]
        with torch.autocast(hc.device.type, enabled=False):
            wc = weight.to(compute)
            grad_h = torch.empty_like(hc)
            need_w = ctx.needs_input_grad[1]
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            scale = grad.float() / count.clamp_min(1)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                h = hc[s:e]
                index = safe[s:e].unsqueeze(1)
                lf = (h @ wc.t()).float()
                lf.sub_(lse[s:e].unsqueeze(1)).exp_()
                lf.scatter_(1, index, lf.gather(1, index) - 1)
                lf.mul_(scale * valid[s:e].unsqueeze(1))
                if compute == torch.float32:
                    torch.mm(lf, wc, out=grad_h[s:e])
                    if need_w:
                        grad_w.addmm_(lf.t(), h)
                    continue
                low = lf.to(compute)
                torch.mm(low, wc, out=grad_h[s:e])
                if need_w:
                    lf.copy_(low)
                    del low
                    grad_w.addmm_(lf.t(), h.float())
            del wc
            if need_w and compute != torch.float32:
                grad_w = grad_w.to(compute) if weight.dtype == compute else grad_w.copy_(grad_w.to(compute))
            if need_w:
                grad_w = grad_w.to(weight.dtype)
        return grad_h.to(ctx.hidden_dtype), grad_w, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: Optional[int] = None, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels``, ``chunk`` tokens at a time.

    ``hidden``: ``[..., hidden]`` (the final norm's output); ``weight``: the head's ``[vocab, hidden]``
    (``model.lm_head.weight``; tied models: the embedding's); ``labels``: ``hidden``'s leading shape,
    already aligned with it (shift them as the model's own loss does before calling), entries equal to
    ``ignore_index`` left out of the mean. ``chunk``: tokens per chunk; default :func:`default_chunk`.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"chunked_cross_entropy: weight {tuple(weight.shape)} for hidden states of width "
                         f"{hidden.shape[-1]}; accepted: weight [vocab, {hidden.shape[-1]}]")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = labels.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"chunked_cross_entropy: {h.shape[0]} hidden rows for {t.shape[0]} labels")
    if chunk is None:
        chunk = default_chunk(h.shape[0], weight.shape[0], weight.shape[1])
    if chunk <= 0:
        raise ValueError(f"chunked_cross_entropy: chunk {chunk}; accepted: a positive number of tokens")
    return _ChunkedCrossEntropy.apply(h, weight, t, int(chunk), ignore_index)
