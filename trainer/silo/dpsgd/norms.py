"""Per-sample gradient norms, the ghost-clipping way where a layer allows it.

Public API:

- `per_sample_grad_norms(model, loss_fn, x, y) -> Tensor`: the L2 norm, over all trainable
  parameters, of each example's gradient; shape (batch,).
- `layer_grads(model, loss_fn, x, y) -> list[LayerGrads]`: one object per parameter-owning layer,
  with `squared_norms()` and `weighted_sum(weights)`; the step builds the clipped sum from these.

Rules, chosen per layer from one recorded forward/backward (`capture.trace_layers`):

- `nn.Linear` on (batch, features): ||dW_i||² = ||a_i||²·||g_i||², ||db_i||² = ||g_i||²: no
  per-sample gradient is ever formed.
- `nn.Linear` on (batch, ..., features), and `nn.Conv2d` unfolded into T patches: the Gram form
  ||dW_i||² = <a_i a_iᵀ, g_i g_iᵀ> when 2T² < p·d (Li et al. 2022, §4: exactly when ghost
  clipping is the cheaper one). Otherwise that one layer's per-sample gradients: a batched matmul
  for Linear; for Conv2d (any stride, dilation, groups) one backward-weight convolution that
  treats the batch as groups, about as cheap as the non-private weight gradient. Early conv layers, with
  T in the hundreds and p·d small, take this path.
- anything else that owns parameters (LayerNorm, Embedding, ...): per-sample gradients of that
  module alone with `torch.func.vmap(grad(...))`, replayed from its recorded input and output
  gradient, so the rest of the model is never re-run.

The clipped sum Σ_i c_i·g_i is read off the same records (`weighted_sum`), e.g. Σ_i c_i g_i a_iᵀ
for a Linear: it equals the gradient of the re-weighted loss Σ_i c_i·ℓ_i that ghost clipping gets
from a second backward (Li et al. 2022, §4), without running that backward (the "book-keeping"
variant, Bu et al. 2023): the input-gradient half of that second backward is never computed.

Not Opacus' `grad_sample_mode="ghost"`: it has no ghost rule for Conv2d, and its norms and clipped
sum live inside its own wrapped model, loss and optimizer, not as values our step can use.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.grad import conv2d_weight

from dpledger.trainer.silo.dpsgd.capture import LayerTrace, LossFn, trace_layers


class LayerGrads(Protocol):
    """Per-example gradients of one layer's own parameters, held in whatever form is cheapest."""

    def squared_norms(self) -> Tensor:
        """Σ over this layer's parameters of ||grad_i||², shape (batch,)."""
        ...

    def weighted_sum(self, weights: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Σ_i weights_i · grad_i for each of this layer's trainable parameters."""
        ...


def _squared_rows(t: Tensor) -> Tensor:
    # One fused pass; an einsum "ni,ni->n" lowers to a batched matmul of 1x1 outputs, far slower.
    norms: Tensor = torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)
    return norms.square()


class _LinearGhost:
    """nn.Linear on (batch, d) inputs: a rank-one gradient per example."""

    def __init__(self, module: nn.Linear, activations: Tensor, grad_output: Tensor) -> None:
        self.module = module
        self.a = activations.to(grad_output.dtype)
        self.g = grad_output

    def squared_norms(self) -> Tensor:
        g_sq = _squared_rows(self.g)
        total = torch.zeros_like(g_sq)
        if self.module.weight.requires_grad:
            total = total + _squared_rows(self.a) * g_sq
        if self.module.bias is not None and self.module.bias.requires_grad:
            total = total + g_sq
        return total

    def weighted_sum(self, weights: Tensor) -> list[tuple[Tensor, Tensor]]:
        out: list[tuple[Tensor, Tensor]] = []
        if self.module.weight.requires_grad:
            out.append((self.module.weight, torch.mm((self.g * weights[:, None]).t(), self.a)))
        if self.module.bias is not None and self.module.bias.requires_grad:
            out.append((self.module.bias, torch.mv(self.g.t(), weights)))
        return out


def _ghost_is_cheaper(*, positions: int, out_features: int, in_features: int) -> bool:
    # Li et al. 2022, §4: the Gram form holds two T x T matrices per example, per-sample
    # gradients one p x d matrix; ghost clipping pays off exactly when 2T² < p·d.
    return 2 * positions * positions < out_features * in_features


class _TokenLayer:
    """A layer whose per-example weight gradient is Σ_t g_t a_tᵀ over T positions: Linear on
    sequences, Conv2d on unfolded patches. Held channels-first: a (N, d, T), g (N, p, T)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, a: Tensor, g: Tensor) -> None:
        self.weight = weight if weight.requires_grad else None
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.a = a.to(g.dtype)
        self.g = g
        self.ghost = _ghost_is_cheaper(positions=a.shape[2], out_features=g.shape[1], in_features=a.shape[1])
        self._per_sample_weight: Tensor | None = None
        if self.weight is not None and not self.ghost:
            self._per_sample_weight = torch.bmm(self.g, self.a.transpose(1, 2))

    def squared_norms(self) -> Tensor:
        total = torch.zeros(self.g.shape[0], dtype=self.g.dtype, device=self.g.device)
        if self.weight is not None:
            if self._per_sample_weight is not None:
                total = total + _squared_rows(self._per_sample_weight)
            else:
                gram_a = torch.bmm(self.a.transpose(1, 2), self.a)
                gram_g = torch.bmm(self.g.transpose(1, 2), self.g)
                # Rounding can push a true zero slightly negative; the norm is taken later.
                total = total + torch.einsum("nst,nst->n", gram_a, gram_g).clamp(min=0)
        if self.bias is not None:
            total = total + _squared_rows(self.g.sum(dim=2))
        return total

    def weighted_sum(self, weights: Tensor) -> list[tuple[Tensor, Tensor]]:
        out: list[tuple[Tensor, Tensor]] = []
        if self.weight is not None:
            if self._per_sample_weight is not None:
                summed = torch.tensordot(weights, self._per_sample_weight, dims=1)
            else:
                summed = torch.einsum("npt,ndt->pd", self.g * weights[:, None, None], self.a)
            out.append((self.weight, summed.reshape(self.weight.shape)))
        if self.bias is not None:
            out.append((self.bias, torch.mv(self.g.sum(dim=2).t(), weights)))
        return out


class _FunctionalPerSample:
    """Any module: per-example gradients of its own parameters by `vmap(grad(...))` of
    <module(x_i), g_i>, whose gradient in the parameters is exactly example i's contribution."""

    def __init__(self, module: nn.Module, name: str, inputs: tuple[Any, ...], grad_output: Tensor) -> None:
        if len(inputs) != 1 or not isinstance(inputs[0], Tensor):
            raise ValueError(
                f"Module {name!r} ({type(module).__name__}) has no ghost rule and takes {len(inputs)} positional "
                "inputs; the per-sample fallback supports modules with one tensor input."
            )
        self.params: dict[str, Tensor] = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        detached = {n: p.detach() for n, p in self.params.items()}

        def contribution(params: dict[str, Tensor], x_i: Tensor, g_i: Tensor) -> Tensor:
            out = functional_call(module, params, (x_i.unsqueeze(0),))
            return torch.sum(out * g_i.unsqueeze(0))

        self.per_sample: dict[str, Tensor] = vmap(grad(contribution), in_dims=(None, 0, 0))(
            detached, inputs[0], grad_output
        )

    def squared_norms(self) -> Tensor:
        return torch.stack([_squared_rows(g) for g in self.per_sample.values()]).sum(dim=0)

    def weighted_sum(self, weights: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [(self.params[n], torch.tensordot(weights.to(g.dtype), g, dims=1)) for n, g in self.per_sample.items()]


class _Conv2dPerSample:
    """Conv2d where T is too large for the Gram form: per-example weight gradients from one
    backward-weight convolution that treats the batch as groups.

    Reshaping the batch (N, C, H, W) into one image of N·C channels, and the layer into N·groups
    groups, makes the backward-weight kernel return each example's gradient as its own group's
    weight gradient. It is the same oneDNN/cuDNN kernel as the non-private weight gradient, at
    about its cost; an im2col copy (kh·kw times the input) followed by batched matmuls is several
    times slower on CPU.
    """

    def __init__(self, module: nn.Conv2d, x: Tensor, g: Tensor) -> None:
        self.module = module
        n, c, h, w = x.shape
        p = g.shape[1]
        self.weight_grads: Tensor | None = None
        if module.weight.requires_grad:
            per_example_weight = (n * p, c // module.groups, *module.kernel_size)
            grads = conv2d_weight(  # type: ignore[no-untyped-call]  # torch.nn.grad has no annotations
                x.to(g.dtype).reshape(1, n * c, h, w),
                per_example_weight,
                g.reshape(1, n * p, g.shape[2], g.shape[3]),
                stride=module.stride,
                padding=module.padding,
                dilation=module.dilation,
                groups=n * module.groups,
            )
            self.weight_grads = grads.reshape(n, -1)
        self.bias = module.bias if module.bias is not None and module.bias.requires_grad else None
        self.bias_grads = g.sum(dim=(2, 3)) if self.bias is not None else None

    def squared_norms(self) -> Tensor:
        parts: list[Tensor] = []
        if self.weight_grads is not None:
            parts.append(_squared_rows(self.weight_grads))
        if self.bias_grads is not None:
            parts.append(_squared_rows(self.bias_grads))
        return torch.stack(parts).sum(dim=0)

    def weighted_sum(self, weights: Tensor) -> list[tuple[Tensor, Tensor]]:
        out: list[tuple[Tensor, Tensor]] = []
        if self.weight_grads is not None:
            out.append((self.module.weight, torch.mv(self.weight_grads.t(), weights).reshape(self.module.weight.shape)))
        if self.bias is not None and self.bias_grads is not None:
            out.append((self.bias, torch.mv(self.bias_grads.t(), weights)))
        return out


def _conv_rule(module: nn.Conv2d, x: Tensor, g: Tensor, *, padding: tuple[int, ...]) -> LayerGrads:
    positions = g.shape[2] * g.shape[3]
    in_features = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
    ghost = _ghost_is_cheaper(positions=positions, out_features=module.out_channels, in_features=in_features)
    if ghost and module.groups == 1:
        patches = F.unfold(
            x, kernel_size=module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
        )
        return _TokenLayer(module.weight, module.bias, patches, g.reshape(x.shape[0], g.shape[1], -1))
    return _Conv2dPerSample(module, x, g)


def _rule_for(trace: LayerTrace) -> LayerGrads:
    module, inputs, g = trace.module, trace.inputs, trace.grad_output
    own_names = {n for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    # Exact types: a subclass may override forward, and then the rule's algebra no longer holds.
    if type(module) is nn.Linear and own_names <= {"weight", "bias"}:
        a = inputs[0]
        if a.dim() == 2:
            return _LinearGhost(module, a, g)
        n = a.shape[0]
        # Every leading dimension after the batch is a position sharing the same weight.
        a_tokens = a.reshape(n, -1, a.shape[-1]).transpose(1, 2)
        g_tokens = g.reshape(n, -1, g.shape[-1]).transpose(1, 2)
        return _TokenLayer(module.weight, module.bias, a_tokens, g_tokens)
    if (
        type(module) is nn.Conv2d
        and own_names <= {"weight", "bias"}
        # Other padding modes pad before the convolution and string paddings may be asymmetric;
        # both go to the generic rule rather than to a second copy of that logic here.
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
        and inputs[0].dim() == 4
    ):
        return _conv_rule(module, inputs[0], g, padding=module.padding)
    return _FunctionalPerSample(module, trace.name, inputs, g)


def layer_grads(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> list[LayerGrads]:
    """Per-layer gradient holders for a batch; empty for an empty batch."""
    if x.shape[0] == 0:
        return []
    return [_rule_for(trace) for trace in trace_layers(model, loss_fn, x, y)]


def norms_from_layers(layers: list[LayerGrads], *, batch_size: int, like: Tensor) -> Tensor:
    """Combine per-layer squared norms: the full gradient's norm is sqrt of their sum."""
    total = torch.zeros(batch_size, dtype=like.dtype, device=like.device)
    for layer in layers:
        total = total + layer.squared_norms()
    return total.sqrt()


def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> Tensor:
    """||∇_θ loss_fn(model(x_i), y_i)|| for each example i, over all trainable parameters, on the
    model's device. Leaves every `.grad` untouched."""
    like = next((p for p in model.parameters() if p.requires_grad), x)
    x, y = x.to(like.device), y.to(like.device)
    return norms_from_layers(layer_grads(model, loss_fn, x, y), batch_size=x.shape[0], like=like)
