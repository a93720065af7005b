"""Fused GPU kernels for the two places where eager PyTorch spends its time on memory traffic
rather than arithmetic (measured on an H200, docs/performance.md "Where the step time goes"):

* `rotary_qkv`: the fused QKV projection's output [b, s, 3, h, hd] -> rotated q, k and v, each
  [b, h, s, hd] contiguous (what flash attention reads), in one pass. Eagerly the interleaved
  rotary is ~7 elementwise kernels per tensor forward and more backward, over strided views
  (inductor's fusion of them took 16 ms a step of the 1.4B model on the H200).
* `cross_entropy_mean`: mean token cross-entropy of bf16 logits [.., V]: one kernel reads each
  row twice (online max/sum-exp, then softmax - onehot) and writes the gradient in the logits'
  dtype during the forward, with fp32 arithmetic throughout. The eager path materialises fp32
  copies of the logits, their log-softmax and their gradient (3 x 3.3 GB at [8, 2048, 50304]).

Each has an eager reference with the same definition, used on CPU (no Triton there). Under
torch.compile the rotary stays a custom op, opaque to inductor; the cross-entropy falls back to
the reference, which inductor fuses with the head. DS3D_FUSED_KERNELS=0
forces the reference (the bench measures both).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def fused_enabled(x: torch.Tensor, under_compile: bool = False) -> bool:
    """The Triton path applies: a CUDA tensor, Triton importable, not switched off by
    DS3D_FUSED_KERNELS=0, and (unless `under_compile`) not being traced by dynamo."""
    return (triton is not None and x.is_cuda and os.environ.get("DS3D_FUSED_KERNELS", "1") != "0"
            and (under_compile or not torch.compiler.is_compiling()))


# --- rotary -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def rotary_tables(seq_len: int, head_dim: int, theta: float,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (inv_freq [hd/2], cos [s, hd/2], sin [s, hd/2]), kept out of the module's buffers so
    that casting the model to bf16 does not round them."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                          / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    return inv, freqs.cos(), freqs.sin()


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoFormer's interleaved rotation of pairs (x[2j], x[2j+1]) of x [b, h, s, hd], in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [b, h, s, hd/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rotary_qkv_reference(qkv: torch.Tensor, theta: float) -> tuple[torch.Tensor, ...]:
    """qkv [b, s, 3, h, hd] -> q, k (rotated), v, each [b, h, s, hd]."""
    _, s, _, _, hd = qkv.shape
    _, cos, sin = rotary_tables(s, hd, theta, qkv.device)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, h, s, hd]
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin), v


if triton is not None:

    @triton.jit
    def _rotate_rows(src, dst, src_off, dst_off, c, s, mask, SIGN: tl.constexpr,
                     BLOCK_H: tl.constexpr, HD: tl.constexpr):
        """Rotates the pairs (x[2j], x[2j+1]) of [BLOCK_H, HD] rows by +-angle; the rows are read
        and written whole (contiguous, vectorised), the pairs split in registers."""
        x = tl.load(src + src_off, mask=mask).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, [BLOCK_H, HD // 2, 2]))
        out = tl.join(even * c - SIGN * odd * s, SIGN * even * s + odd * c)
        tl.store(dst + dst_off, tl.reshape(out, [BLOCK_H, HD]).to(dst.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _rotary_qkv_kernel(packed, q, k, v, inv_freq, S, H,
                           HD: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
        """One program per token (b, pos). Forward: packed [b, s, 3, h, hd] -> q, k, v
        [b, h, s, hd] with q, k rotated by +angle. Backward: the gradients the other way,
        rotated by -angle (the rotation's transpose)."""
        row = tl.program_id(0)
        b = row // S
        pos = row % S
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, HD)[None, :]
        mask = heads < H
        ang = pos.to(tl.float32) * tl.load(inv_freq + tl.arange(0, HD // 2))
        c = tl.cos(ang)[None, :]
        s = tl.sin(ang)[None, :]
        packed_off = row.to(tl.int64) * 3 * H * HD + heads * HD + dims
        split_off = ((b.to(tl.int64) * H + heads) * S + pos) * HD + dims
        if BACKWARD:
            _rotate_rows(q, packed, split_off, packed_off, c, s, mask, -1.0, BLOCK_H, HD)
            _rotate_rows(k, packed, split_off, packed_off + H * HD, c, s, mask, -1.0, BLOCK_H, HD)
            tl.store(packed + packed_off + 2 * H * HD, tl.load(v + split_off, mask=mask),
                     mask=mask)
        else:
            _rotate_rows(packed, q, packed_off, split_off, c, s, mask, 1.0, BLOCK_H, HD)
            _rotate_rows(packed, k, packed_off + H * HD, split_off, c, s, mask, 1.0, BLOCK_H, HD)
            tl.store(v + split_off, tl.load(packed + packed_off + 2 * H * HD, mask=mask),
                     mask=mask)

    def _launch_rotary(packed, q, k, v, inv, backward: bool) -> None:
        b, s, _, h, hd = packed.shape
        _rotary_qkv_kernel[(b * s,)](packed, q, k, v, inv, s, h, HD=hd,
                                     BLOCK_H=triton.next_power_of_2(h), BACKWARD=backward,
                                     num_warps=4)

    # Custom ops rather than plain autograd Functions: torch.compile keeps each as one opaque
    # node (inductor's own fusion of the reference was ~4x slower), eager pays one dispatch.
    @torch.library.custom_op("ds3d::rotary_qkv", mutates_args=())
    def _rotary_qkv_op(qkv: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
        b, s, _, h, hd = qkv.shape
        inv, _, _ = rotary_tables(s, hd, theta, qkv.device)
        q, k, v = (torch.empty((b, h, s, hd), dtype=qkv.dtype, device=qkv.device)
                   for _ in range(3))
        _launch_rotary(qkv.contiguous(), q, k, v, inv, backward=False)
        return q, k, v

    @_rotary_qkv_op.register_fake
    def _rotary_qkv_fake(qkv, theta):
        b, s, _, h, hd = qkv.shape
        return tuple(qkv.new_empty((b, h, s, hd)) for _ in range(3))

    @torch.library.custom_op("ds3d::rotary_qkv_backward", mutates_args=())
    def _rotary_qkv_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                                theta: float) -> torch.Tensor:
        b, h, s, hd = dq.shape
        inv, _, _ = rotary_tables(s, hd, theta, dq.device)
        dpacked = torch.empty((b, s, 3, h, hd), dtype=dq.dtype, device=dq.device)
        _launch_rotary(dpacked, dq.contiguous(), dk.contiguous(), dv.contiguous(), inv,
                       backward=True)
        return dpacked

    @_rotary_qkv_backward_op.register_fake
    def _rotary_qkv_backward_fake(dq, dk, dv, theta):
        b, h, s, hd = dq.shape
        return dq.new_empty((b, s, 3, h, hd))

    def _rotary_setup(ctx, inputs, output):
        ctx.theta = inputs[1]

    def _rotary_backward(ctx, dq, dk, dv):
        return _rotary_qkv_backward_op(dq, dk, dv, ctx.theta), None

    _rotary_qkv_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def rotary_qkv(qkv: torch.Tensor, theta: float) -> tuple[torch.Tensor, ...]:
    """qkv [b, s, 3, h, hd] (Q, K, V of h heads) -> q, k rotated by position, and v, each
    [b, h, s, hd]."""
    hd = qkv.shape[-1]
    if fused_enabled(qkv, under_compile=True) and hd % 2 == 0 and (hd & (hd - 1)) == 0:
        return _rotary_qkv_op(qkv, theta)
    return rotary_qkv_reference(qkv, theta)


# --- cross-entropy ----------------------------------------------------------------------------


if triton is not None:

    @triton.jit
    def _cross_entropy_kernel(logits, targets, losses, grad, scale, V: tl.constexpr,
                              BLOCK: tl.constexpr):
        """One program per row: loss = logsumexp(x) - x[target]; grad = (softmax(x) -
        onehot(target)) * scale, stored in the logits' dtype."""
        row = tl.program_id(0).to(tl.int64)
        x_row = logits + row * V
        g_row = grad + row * V
        cols = tl.arange(0, BLOCK)
        # lanes past V read -1e30, not -inf: exp(m - m_new) stays finite (never inf - inf), and
        # such a lane's sum is weighted by exp(-1e30 - row_max) = 0 at the end
        m = tl.full([BLOCK], -1e30, tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, V, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=-1e30).to(tl.float32)
            m_new = tl.maximum(m, x)
            acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        row_max = tl.max(m, axis=0)
        lse = row_max + tl.log(tl.sum(acc * tl.exp(m - row_max), axis=0))
        target = tl.load(targets + row)
        tl.store(losses + row, lse - tl.load(x_row + target).to(tl.float32))
        for start in tl.range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)
            tl.store(g_row + idx, (p * scale).to(grad.dtype.element_ty), mask=idx < V)


def scale_by_loss_grad_(grad: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """`grad.mul_(grad_out)`, skipped when grad_out is exactly 1 (x * 1.0 == x, bit for bit):
    the loss's own gradient is 1 unless the loss was scaled (gradient accumulation), and the
    multiply is an unvectorized pass over [tokens, vocab] (3.4 ms a step on the 1.4B model,
    H200, docs/performance.md) for nothing. Reading grad_out costs one host sync per step."""
    if grad_out.numel() != 1 or grad_out.item() != 1.0:
        grad.mul_(grad_out)
    return grad


class _CrossEntropyMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):  # type: ignore[override]
        v = logits.shape[-1]
        x = logits.reshape(-1, v).contiguous()
        t = targets.reshape(-1).contiguous()
        n = x.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=x.device)
        grad = torch.empty_like(x)
        _cross_entropy_kernel[(n,)](x, t, losses, grad, 1.0 / n, V=v,
                                    BLOCK=min(4096, triton.next_power_of_2(v)), num_warps=16)
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return scale_by_loss_grad_(grad, grad_out).view(ctx.shape), None


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [..., V] against integer targets [...], computed in fp32
    (every target must be a valid class: ds3d's data has no padding)."""
    if fused_enabled(logits) and logits.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return _CrossEntropyMean.apply(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
