"""The scoped and one-shot forms of a capture: ``capture()`` and ``run_with_capture()``.

Both build one :class:`~hookscope._capture.options.CaptureOptions` and one
:class:`~hookscope._capture.recorder.Capture`; the one-shot form also runs the model (and, with
``backward=``, one backward to the kept values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookscope._capture.cache import Cache
from hookscope._capture.options import CaptureOptions
from hookscope._capture.recorder import Capture, StopForward
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.select import Selector, ensure_module, given_selectors
from hookscope._shared.options import with_options
from hookscope.errors import CaptureError, SpecError

__all__ = ["capture", "run_with_capture"]


@with_options(CaptureOptions)
def capture(
    model: nn.Module,
    *selectors: Selector,
    layers: Selector | Sequence[Selector] | None = None,
    options: CaptureOptions | None = None,
    **opts: Any,
) -> Capture:
    """Keep the outputs (or inputs) of the modules the selectors pick, for each forward pass.

    The modules are chosen by selectors, given positionally or as ``layers=`` (one selector or
    a list). The options are those of :class:`CaptureOptions`, as keywords or whole
    (``options=hs.CaptureOptions(...)``, which a type checker reads field by field).

    Values are detached (``detach=False`` keeps the graph), stay on the device they were made on
    (``device="cpu"`` moves them; from CUDA through pinned memory, one sync per forward), and may
    be cast (``dtype``, floating values only) or reduced on the device first (``reduce="mean:1"``
    or a function). ``calls`` keeps ``"all"`` calls of a reused module, the ``"first"``, the
    ``"last"``, or one index. ``keep="input"`` or ``"both"`` also keeps inputs, keyword inputs
    included (paths ``[0]``, ``['scale']``). ``max_bytes`` (``1 << 30`` or ``"1GiB"``) stops a
    capture that would outgrow its budget with an error naming the largest sites. ``stop=True``
    ends the forward once every selected module has been captured (its first call, or the
    chosen index): the rest of the model does not run, and ``model(x)`` inside the ``with``
    block ends the block. A later in-place op never changes a kept value (see ``copy``).
    ``grads=True`` also keeps the gradient with respect to each kept value once a backward
    reaches it (``cache.grad["fc"]``, after ``loss.backward()``; ``run_with_capture(...,
    backward=metric)`` runs both), the gradient of the value as kept even if an in-place op
    changed it afterwards.
    Each call of the model is a pass and starts a new cache; ``passes="all"`` keeps every
    pass's cache (``capture.passes``; ``max_bytes`` then spans them all), for a loop that calls
    the model several times, such as ``generate``. A checkpointed block recomputing its forward
    in backward is not a pass: it neither adds values nor replaces them.

    Memory: once a pass ends holding 64 MiB or more on the host, glibc is asked (once per
    process) to keep freed memory resident up to twice that, at most 2 GiB, so the next
    forward reuses the pages instead of faulting them in again; ``HOOKSCOPE_MALLOC=default``
    in the environment leaves the allocator alone (see :mod:`hookscope._shared.malloc`).

    Op sites: a selector ``"h.0.attn:op[softmax#0]"`` keeps what a torch op called by the
    module's own code returns (``"h.*.attn:op[softmax]"``: every index, ``"layer1.0:op[add*]"``:
    a glob), read back as ``cap["h.0.attn:op[softmax#0]"]``, ``cap["h.0.attn#1:op[softmax#0]"]``
    (call 1), ``cap["h.0.attn:op[softmax]"]`` (the one index held), ``cap[":op[split#0][1]"]``
    (a leaf). ``keep="both"`` or ``"input"`` also keeps an op's tensor arguments
    (``:op[add#0]:input[1]``; not the argument an in-place op writes into, which holds its
    output by then). Every option above applies, but ``stop``. An op selector whose module
    ran but whose op never did raises ``CaptureError`` at the end of the pass, naming the ops
    the module called; under ``torch.compile`` each watched module runs eagerly (a graph break
    around it), so its op sites hold the eager values.

    Attention sub-sites: ``"h.*.attn:attn.pattern"`` keeps, for each
    ``F.scaled_dot_product_attention`` call the module's own code makes (transformers'
    ``attn_implementation="sdpa"``), the probabilities; ``:attn.scores`` the pre-softmax scores
    (masked as the kernel masks, ``-inf`` where masked), ``:attn.q``, ``:attn.k``, ``:attn.v``
    the kernel's arguments, ``:attn.z`` its output per head (before the heads are merged). The
    scores and pattern are recomputed from the call's arguments only when selected: O(seq^2)
    memory per head, which ``reduce``, ``dtype`` and ``max_bytes`` apply to. ``#1`` picks the
    module's second kernel call (keys without an index name the first); ``keep`` does not apply.
    A module that never called the kernel (eager attention) raises with the fix;
    ``nn.MultiheadAttention`` is refused (it runs the kernel inside ``F.multi_head_attention_forward``).

    Example::

        with hs.capture(model, "layer*.conv2", "fc") as cap:
            model(x)
        cap["fc"]                      # fc's output (last call)
        cap.calls("layer1.0.conv2")    # every call, in order
        cap.numpy(); cap.save("feats.safetensors")
    """
    return Capture(model, given_selectors(selectors, layers, feature="capture"), CaptureOptions.build(options, opts))


@with_options(CaptureOptions, keep=("model_kwargs",))
def run_with_capture(
    model: nn.Module,
    *args: Any,
    layers: Selector | Sequence[Selector],
    options: CaptureOptions | None = None,
    backward: Callable[[Any], torch.Tensor] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Cache]:
    """Run ``model(*args, **kwargs)`` once with a capture; return ``(output, cache)``.

    ``backward=metric`` also runs one backward from ``metric(output)`` (a scalar; one value per
    row is summed, so each row's gradients are its own metric's) and keeps the gradient with
    respect to every captured value as ``cache.grad[site]`` (``grads=True`` is implied). The
    backward reaches only the captured values: parameters' ``.grad`` are left as they were.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x = torch.randn(3, 4)
    >>> out, cache = run_with_capture(model, x, layers="1", backward=lambda out: out.sum())
    >>> h = model[0](x).tanh().detach().requires_grad_()
    >>> reference, = torch.autograd.grad(model[2](h).sum(), h)
    >>> torch.allclose(cache.grad["1"], reference), model[0].weight.grad is None
    (True, True)

    ``layers`` is one selector or a list of them; the options are :class:`CaptureOptions`'
    (:func:`capture`'s). Keyword arguments that are not options go to the model
    (``model_kwargs`` passes ones whose names clash with an option). With ``stop=True`` the
    output is ``None``.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    >>> out, cache = run_with_capture(model, torch.randn(3, 4), layers=["0", "2"])
    >>> cache["0"].shape, torch.equal(cache["2"], out)
    (torch.Size([3, 8]), True)
    >>> bool((cache["0"] < 0).any())  # the in-place ReLU did not touch the kept value
    True

    Op sites are selectors too: ``"module:op[name#index]"`` keeps the output of a torch op
    that the module's own code calls (``keep="both"``: its tensor arguments as well, under
    ``:input[i]``); ``hs.layers(model, x, ops=True)`` lists them.

    >>> model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    >>> out, cache = run_with_capture(model, torch.randn(2, 4), layers=["1:op[softmax#0]", "0"], keep="both")
    >>> torch.equal(cache["1:op[softmax#0]"], out), torch.equal(cache["1:op[softmax]:input[0]"], cache["0"])
    (True, True)
    >>> sorted(cache.numpy())
    ['0#0:input[0]', '0#0:output', '1#0:op[softmax#0]', '1#0:op[softmax#0]:input[0]']
    """
    chosen, model_kw = CaptureOptions.split(kwargs)
    ensure_loaded(ensure_module(model), (args, model_kw, model_kwargs))  # a meta model: one line, not torch's
    built = CaptureOptions.build(options, chosen)
    if backward is not None:
        if not callable(backward):
            raise SpecError(f"backward={backward!r}: expected a function of the model's output returning a scalar")
        if built.stop:
            raise SpecError("backward= needs the model's output, and stop=True ends the forward before it: use one")
        built = dataclasses.replace(built, grads=True)
    recorder = Capture(model, given_selectors((), layers, feature="capture"), built)
    with recorder:
        try:
            output = model(*args, **{**model_kw, **(model_kwargs or {})})
        except StopForward as stopped:
            if stopped.owner is not recorder:
                raise
            output = None
    if backward is not None:
        _backward(backward, output, recorder._keeper.grad_edges)
    return output, recorder.cache


def _backward(metric: Callable[[Any], torch.Tensor], output: Any, edges: list[Any]) -> None:
    """Differentiate ``metric(output)`` with respect to the kept values only (their hooks keep
    the gradients); a metric that is not a differentiable tensor is refused with the reason."""
    value = metric(output)
    if not isinstance(value, torch.Tensor):
        raise SpecError(f"the backward metric returned {type(value).__name__}; expected a tensor (a scalar)")
    if value.dim() > 1:
        raise SpecError(
            f"the backward metric returned shape {tuple(value.shape)}; expected a scalar or one value per row"
        )
    if not value.requires_grad:
        raise CaptureError(
            "the backward metric does not depend on anything in autograd's graph (run the model outside "
            "torch.no_grad() and inference_mode(), with weights that require grad: frozen weights, "
            "requires_grad_(False), leave nothing to differentiate)"
        )
    if not edges:
        raise CaptureError(
            "no captured value is in autograd's graph, so no gradient can be kept: run the model outside "
            "torch.no_grad() and inference_mode(), and capture values the output depends on"
        )
    try:
        torch.autograd.grad(value.sum(), edges, allow_unused=True)
    except RuntimeError as error:
        if "reentrant" not in str(error):
            raise
        raise CaptureError(
            "backward= cannot reach values through a block checkpointed with use_reentrant=True (PyTorch allows "
            "only .backward() there); checkpoint with use_reentrant=False "
            "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
        ) from error
