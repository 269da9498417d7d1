"""Attention over padded keys on a CUDA card's flash kernel (VarlenAttention, the twin of MultiHeadAttention):
torch's variable-length kernel, given where each sentence's real keys are, skips the padding instead of
masking it (tests/test_varlen.py holds the layout to the plain definition).

torch's fused attention cannot take a padding mask into its flash kernel, so masked attention, the
encoder's self-attention and the decoder's source attention, runs the memory-efficient kernel and
computes every padded key. The variable-length kernel takes the batch as segments instead: cumulative
offsets of queries and keys, each query segment attending to the key segment of the same number.
Here the batch keeps its padded layout, (B, T) flattened to B·T rows, and each sentence i is two
segments: all T of its queries with its real keys, then no queries with its padding keys. That is
exactly what the key mask lets a query see, padding queries included, so the result is the plain
attention's, row for row; no segment with queries lacks keys (every sentence has a real token, its
</s>), and the offsets come from the mask on the device, with no host read. It takes the batches as
training makes them: each sentence's padding after its tokens."""

from __future__ import annotations

import torch

from transformer.model.attention import Mask, MultiHeadAttention

KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what flash computes in
FLASH_CAPABILITY = (8, 0)  # the oldest CUDA compute capability torch's flash kernels run on


def flash_kernel(q, k, v, *, cu_q, cu_k, max_q, max_k):
    """torch's variable-length flash attention: query rows cu_q[i]:cu_q[i + 1] of q (rows, h, d_k)
    attend to key rows cu_k[i]:cu_k[i + 1] of k and v; no segment longer than max_q, max_k."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q, max_k=max_k)


class VarlenAttention(MultiHeadAttention):
    """MultiHeadAttention whose key-masked attention in training runs on `kernel`, torch's flash kernel
    for variable lengths, in the dtypes it computes in (`dtypes`). Causal attention (flash already:
    it takes no mask), decoding, kept weights and dropped weights (the kernel has no dropout) go
    torch's way, as does any other dtype."""

    kernel = staticmethod(flash_kernel)
    dtypes = KERNEL_DTYPES

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        plain = mask.causal or mask.keys is None or self.keep_weights or not self.training or self.dropout > 0
        if plain or q.dtype not in self.dtypes:
            return super().attend(q, k, v, mask)
        return by_sentence(q, k, v, mask.keys, self.kernel)


def by_sentence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, kernel) -> torch.Tensor:
    """Equation 1 of q (B, h, T, d_k) over the keys of k, v (B, h, S, d_k) that the key mask `keys`
    (B, 1, 1, S) lets each sentence see, its first ones (padding follows the tokens), computed by a
    variable-length `kernel` (flash_kernel's arguments), (B, h, T, d_k)."""
    B, h, T, d_k = q.shape
    S = k.size(2)
    real_keys = keys.flatten(1).sum(1, dtype=torch.int32)
    rows = torch.arange(1, B + 1, device=q.device, dtype=torch.int32)
    first = torch.zeros(1, device=q.device, dtype=torch.int32)
    # Sentence i: queries i·T to (i + 1)·T, then none; its real keys, then its padding keys.
    cu_q = torch.cat([first, (rows * T).repeat_interleave(2)])
    cu_k = torch.cat([first, torch.stack([(rows - 1) * S + real_keys, rows * S], 1).flatten()])
    flat = [t.transpose(1, 2).reshape(-1, h, d_k) for t in (q, k, v)]  # (B·T or B·S, h, d_k): views
    return kernel(*flat, cu_q=cu_q, cu_k=cu_k, max_q=T, max_k=S).view(B, T, h, d_k).transpose(1, 2)
