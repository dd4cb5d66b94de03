"""One forward and one backward that record what the per-sample gradient rules need.

For every module that owns trainable parameters directly, we keep its positional inputs and the
gradient of the summed per-example loss with respect to its output. Because examples do not
interact (no BatchNorm), row i of that output gradient is the gradient of example i's loss alone,
which is all that ghost norms and the re-weighted (clipped) sum need (Li et al. 2022, §4).

The backward asks autograd for gradients with respect to the layers' outputs only, so it skips
every weight gradient: it costs about one forward, not one full backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.modules.batchnorm import _BatchNorm

LossFn = Callable[[Tensor, Tensor], Tensor]
"""(model output, targets) -> per-example losses of shape (batch,), i.e. reduction="none"."""


@dataclass(frozen=True)
class LayerTrace:
    """A parameter-owning module as it ran in one forward pass."""

    name: str
    module: nn.Module
    inputs: tuple[Any, ...]
    grad_output: Tensor


@dataclass
class _Pending:
    name: str
    inputs: tuple[Any, ...]
    input_versions: tuple[int, ...]
    # The edge, not the output tensor: an in-place op after the layer (ReLU(inplace=True)) rebinds
    # the tensor to a new autograd node, while the edge still points at the layer's own output.
    edge: GradientEdge
    output_shape: torch.Size
    output_dtype: torch.dtype
    output_device: torch.device


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def parameter_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own trainable parameters directly, in `named_modules` order."""
    owners: list[tuple[str, nn.Module]] = []
    seen: dict[int, str] = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        for p in own:
            if id(p) in seen:
                # Tied weights get gradient contributions from two layers; the per-sample norm
                # would need the cross term between them, which no per-layer rule sees.
                raise ValueError(f"Parameter shared by modules {seen[id(p)]!r} and {name!r} is not supported.")
            seen[id(p)] = name
        if own:
            owners.append((name, module))
    return owners


def _tensor_versions(values: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(v._version for v in values if isinstance(v, Tensor))


def trace_layers(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> list[LayerTrace]:
    """Run `model` on a non-empty batch and return the trace of every parameter-owning module
    that took part, in the order the modules appear in `model.named_modules()`."""
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.training:
            raise ValueError(
                f"Module {name!r} is a BatchNorm in training mode; it mixes examples of a batch, so "
                "per-sample gradients are undefined. Use GroupNorm or LayerNorm."
            )
    owners = parameter_owners(model)
    pending: dict[int, _Pending] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"Module {name!r} returned {type(output).__name__}; only a single tensor output is supported."
                )
            if id(module) in pending:
                # A module called twice accumulates two gradient terms per example; their cross
                # term is not visible to a per-call rule.
                raise ValueError(
                    f"Module {name!r} was called more than once in one forward pass; reused modules are not supported."
                )
            pending[id(module)] = _Pending(
                name=name,
                inputs=args,
                input_versions=_tensor_versions(args),
                edge=get_gradient_edge(output),
                output_shape=output.shape,
                output_dtype=output.dtype,
                output_device=output.device,
            )

        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in owners]
    try:
        with torch.enable_grad():
            losses = loss_fn(model(x), y)
    finally:
        for handle in handles:
            handle.remove()
    if losses.shape != (x.shape[0],):
        raise ValueError(
            f"loss_fn must return per-example losses of shape ({x.shape[0]},). Found {tuple(losses.shape)}."
        )

    ran = [(module, pending[id(module)]) for _, module in owners if id(module) in pending]
    for _, entry in ran:
        if _tensor_versions(entry.inputs) != entry.input_versions:
            raise ValueError(
                f"An input of module {entry.name!r} was modified in place after the module used it; "
                "its recorded activation would be stale. Avoid in-place ops on layer inputs."
            )
    if not ran:
        return []

    if losses.requires_grad:
        grads: tuple[Tensor | None, ...] = torch.autograd.grad(
            losses.sum(), [entry.edge for _, entry in ran], allow_unused=True
        )
    else:
        grads = (None,) * len(ran)

    traces: list[LayerTrace] = []
    for (module, entry), grad in zip(ran, grads, strict=True):
        if grad is None:
            # The layer ran but does not reach the loss: every example's gradient is zero there.
            grad = torch.zeros(entry.output_shape, dtype=entry.output_dtype, device=entry.output_device)
        inputs = tuple(v.detach() if isinstance(v, Tensor) else v for v in entry.inputs)
        traces.append(LayerTrace(name=entry.name, module=module, inputs=inputs, grad_output=grad))
    return traces
