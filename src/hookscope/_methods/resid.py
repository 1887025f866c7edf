"""The residual stream as a stack: accumulated (the stream after each block) or decomposed (what
each component wrote into it), and the model's final norm applied to either.

Both read canonical names (``std:``), so one call works on GPT-2, Llama or any model the map
knows. The decomposition is ``resid_pre`` of the first block (labelled ``embed``: whatever enters
the blocks, position embeddings and embedding scales included), then each block's ``attn`` and
``mlp`` (and, in encoder-decoder decoders, ``cross_attn``): the terms the blocks add, so they sum
to the last ``resid_post``; the sum is checked value by value against the rounding the model's
adds can leave there, and blocks that normalise after each add (post-norm: BERT, BART) are
refused with the reason, in every dtype.
"""

from __future__ import annotations

import math
from typing import Any, overload

import torch
from torch import nn

from hookscope._arch.std import known_std_map
from hookscope._capture import Cache, Stacked, run_with_capture
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.std_names import STD_PREFIX, StdMap, StdSite
from hookscope._methods.checks import refuse_training
from hookscope._methods.runs import Inputs
from hookscope.errors import SpecError

__all__ = [
    "Stacked",
    "accumulated_resid",
    "apply_ln",
    "block_count",
    "captured_run",
    "decompose_resid",
    "final_norm",
    "stack_std",
    "unembed",
    "unembed_site",
]


def stack_std(cache: Cache, names: list[str]) -> Stacked:
    """The values of canonical ``names`` in ``cache``, stacked along a new first axis."""
    values = [cache[STD_PREFIX + name] for name in names]
    shapes = {tuple(value.shape) for value in values}
    if len(shapes) > 1:
        raise SpecError(f"cannot stack {names[0]}..{names[-1]}: their shapes differ ({sorted(shapes)})")
    return Stacked(torch.stack(values), list(names))


def block_count(std: StdMap, prefix: str) -> int:
    """The blocks of the stack ``prefix`` names; none is refused, naming the stacks an encoder-decoder has."""
    count = 0
    while f"{prefix}blocks.{count}.resid_pre" in std:
        count += 1
    if not count:
        hint = ""
        if not prefix and any(name.startswith(("encoder.blocks.", "decoder.blocks.")) for name in std):
            hint = '; an encoder-decoder model: pass stack="decoder." (or "encoder.")'
        raise SpecError(
            f"this model's canonical map ({std.family}) has no {prefix}blocks.*.resid_pre: no residual stream{hint}"
        )
    return count


def accumulated_resid(
    model: nn.Module,
    inputs: Any,
    *,
    mid: bool = False,
    apply_final_norm: bool = False,
    stack: str = "",
    model_kwargs: dict[str, Any] | None = None,
) -> Stacked:
    """The residual stream entering each block, then after the last: ``(blocks + 1, batch, seq, d_model)``.

    ``mid=True`` adds each block's ``resid_mid`` (after attention) between them;
    ``apply_final_norm=True`` puts each through the model's final norm, as the logit lens does.
    ``stack="decoder."`` reads an encoder-decoder's decoder (``"encoder."`` its encoder).

    Example::

        resid, labels = hs.methods.accumulated_resid(gpt2, ids)
        labels[:2], resid.shape            # ['blocks.0.resid_pre', 'blocks.1.resid_pre'], (13, 1, 8, 768)
    """
    std = known_std_map(model)
    count = block_count(std, stack)
    names = []
    for index in range(count):
        names.append(f"{stack}blocks.{index}.resid_pre")
        if mid:
            names.append(f"{stack}blocks.{index}.resid_mid")
    names.append(f"{stack}blocks.{count - 1}.resid_post")
    stacked = stack_std(_captured(model, inputs, names, model_kwargs, "accumulated_resid"), names)
    return apply_ln(stacked, model, stack=stack) if apply_final_norm else stacked


def decompose_resid(
    model: nn.Module, inputs: Any, *, stack: str = "", model_kwargs: dict[str, Any] | None = None
) -> Stacked:
    """What each component added to the residual stream: ``embed`` (the stream entering the first
    block), then each block's ``attn`` and ``mlp``; they sum to the last ``resid_post`` (checked).

    Example::

        parts, labels = hs.methods.decompose_resid(gpt2, ids)
        torch.testing.assert_close(parts.sum(0), cache["std:blocks.11.resid_post"])
    """
    ensure_loaded(model)  # a meta model: one line, not torch's error
    std = known_std_map(model)
    count = block_count(std, stack)
    names = [f"{stack}blocks.0.resid_pre"]
    for index in range(count):
        for part in ("attn", "cross_attn", "mlp"):
            if f"{stack}blocks.{index}.{part}" in std:
                names.append(f"{stack}blocks.{index}.{part}")
    last = f"{stack}blocks.{count - 1}.resid_post"
    cache = _captured(model, inputs, [*names, last], model_kwargs, "decompose_resid")
    stacked = stack_std(cache, names)
    final = cache[STD_PREFIX + last]
    error, allowed = _sum_error(stacked.tensor, final)
    if not error <= allowed:
        raise SpecError(
            f"the components of {std.family}'s residual stream do not sum to {last} (an error of {error:.3g} where "
            f"{final.dtype} rounding of the adds allows {allowed:.3g}): its blocks normalise after each add "
            "(post-norm) or add more than attention and the MLP; use accumulated_resid, which reads the stream itself"
        )
    return Stacked(stacked.tensor, ["embed", *names[1:]])


def _sum_error(parts: torch.Tensor, final: torch.Tensor) -> tuple[float, float]:
    """How far ``parts`` sum from ``final`` at the value where that is worst against what rounding
    allows there, and that allowance.

    The parts are the values the model added, kept exactly as it held them, so summing them in
    float64 leaves only the rounding of the model's own adds: each add rounds its result once, by
    at most half a unit in the last place, ``u * |partial sum|``. So at every value the error is
    at most ``u`` times the sum of the partial sums' magnitudes there; twice that covers a model
    that adds in another order (a parallel block's ``attn + mlp`` first). A post-norm block's
    norm moves values by far more, at values whose partial sums are small, where no rounding
    reaches: a bound of the largest value (or of ``hs.diff``'s bf16 tolerance) let BERT pass."""
    if parts.shape[1:] != final.shape:
        return math.inf, 0.0
    unit = max(torch.finfo(parts.dtype).eps, torch.finfo(final.dtype).eps) / 2
    running = parts.double().cumsum(0)  # the partial sums, each add's result
    error = (running[-1] - final.double()).abs()
    allowed = 2 * unit * running[1:].abs().sum(0)
    worst = int((error - allowed).reshape(-1).argmax())
    return float(error.reshape(-1)[worst]), float(allowed.reshape(-1)[worst])


def captured_run(
    model: nn.Module, inputs: Any, layers: list[str], model_kwargs: dict[str, Any] | None, method: str
) -> tuple[Any, Cache, int]:
    """One forward of ``inputs`` without a graph, capturing ``layers``: the output, the cache and
    the rows; a model in training mode is refused first."""
    refuse_training(model, method)
    given = Inputs.of(inputs, "inputs", model_kwargs)
    with torch.no_grad():
        output, cache = run_with_capture(model, *given.args, layers=layers, model_kwargs=given.kwargs)
    return output, cache, given.rows


def _captured(
    model: nn.Module, inputs: Any, names: list[str], model_kwargs: dict[str, Any] | None, method: str
) -> Cache:
    return captured_run(model, inputs, [STD_PREFIX + n for n in names], model_kwargs, method)[1]


def final_norm(model: nn.Module, stack: str = "", *, or_identity: bool = False) -> nn.Module:
    """The model's final norm (``std:ln_final``), the module itself; with ``or_identity``, an
    ``nn.Identity`` for a model the map says has none (post-norm stacks end in a block's own norm)."""
    name = f"{stack}ln_final"
    if or_identity and name in known_std_map(model).missing:
        return nn.Identity()
    return _module(model, name, "a final norm")


def unembed(model: nn.Module, stack: str = "") -> nn.Module:
    """The model's unembedding (``std:unembed``, the LM head), the module itself."""
    return model.get_submodule(unembed_site(model, stack).module or "")


def unembed_site(model: nn.Module, stack: str = "") -> StdSite:
    """The canonical site of the LM head: the stack's own where it has one, else the model's."""
    return _site(model, f"{stack}unembed" if f"{stack}unembed" in known_std_map(model) else "unembed", "an LM head")


def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    return model.get_submodule(_site(model, name, what).module or "")


def _site(model: nn.Module, name: str, what: str) -> StdSite:
    std = known_std_map(model)
    site = std.get(name)
    if site is None or site.module is None:
        why = std.missing.get(name, "the map does not name it")
        raise SpecError(
            f"this model has no std:{name} ({why}); the logit lens and apply_ln need {what}: use a model with one "
            "(a transformers ...ForCausalLM, not the bare ...Model; an encoder-decoder's decoder: stack='decoder.')"
        )
    return site


@overload
def apply_ln(
    stacked: Stacked, model: nn.Module, *, scale_of: torch.Tensor | None = None, stack: str = ""
) -> Stacked: ...


@overload
def apply_ln(
    stacked: torch.Tensor, model: nn.Module, *, scale_of: torch.Tensor | None = None, stack: str = ""
) -> torch.Tensor: ...


def apply_ln(
    stacked: Stacked | torch.Tensor, model: nn.Module, *, scale_of: torch.Tensor | None = None, stack: str = ""
) -> Stacked | torch.Tensor:
    """The model's final norm applied to each slice of a stack: a ``Stacked`` (the result keeps its
    labels) or its tensor alone (``parts`` of ``parts, labels = decompose_resid(...)``; a tensor back).

    Without ``scale_of`` each slice goes through the norm on its own (the accumulated stream, as
    the logit lens reads it). With ``scale_of`` (the final residual the slices sum to) the norm is
    applied as the linear map it is once its scale is fixed, with that residual's scale: the
    slices then sum to ``ln_final(scale_of)`` minus the norm's bias, so each component's share of
    the normalised stream (and, through the unembedding, of the logits) adds up. The linear part
    is read from the norm module itself (its odd part, ``(norm(x) - norm(-x)) / 2``), so LayerNorm,
    RMSNorm and variants with ``1 + weight`` are all taken as they compute.

    Example::

        parts, labels = hs.methods.decompose_resid(gpt2, ids)
        normed = hs.methods.apply_ln(parts, gpt2, scale_of=parts.sum(0))
        per_component = normed @ gpt2.lm_head.weight.T
        # per_component.sum(0) + gpt2.transformer.ln_f.bias @ gpt2.lm_head.weight.T is the logits
    """
    if isinstance(stacked, Stacked):
        return Stacked(apply_ln(stacked.tensor, model, scale_of=scale_of, stack=stack), stacked.labels)
    if not isinstance(stacked, torch.Tensor):
        raise SpecError(
            f"apply_ln({type(stacked).__name__}): expected a Stacked (what decompose_resid and accumulated_resid "
            "return) or its tensor of slices stacked on dim 0"
        )
    norm = final_norm(model, stack)
    with torch.no_grad():
        if scale_of is None:
            return torch.stack([norm(value) for value in stacked])
        return linear_norm(norm, stacked, scale_of)


def linear_norm(norm: nn.Module, parts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Each of ``parts`` (stacked on dim 0) through ``norm`` with the scale of ``total`` fixed.

    A norm of the form ``weight * centre(x) / scale(x) + bias`` is linear in ``x`` once the scale
    is fixed. The weight and whether it centres are read from the module on probes; the scale of
    ``total`` from the module's own output, so ``eps`` and conventions are the module's.
    """
    width = total.shape[-1]
    if width % 2:
        raise SpecError(f"apply_ln(scale_of=...) reads the norm on probes of even width; d_model is {width}")
    probe = torch.ones(width, device=total.device, dtype=total.dtype)
    probe[1::2] = -1.0
    probe = (probe - probe.mean()) * 1e3  # centred, no zero entry where width is even; scale ~1e3 hides eps
    odd = (norm(probe) - norm(-probe)) / 2  # weight * probe / scale(probe)
    probe_scale = probe.pow(2).mean().sqrt()
    weight = odd * probe_scale / probe
    shifted = norm(probe + 7.0)  # a centring norm ignores the shift
    centres = bool(torch.allclose(shifted, norm(probe), atol=1e-4, rtol=1e-4))

    def centred(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if centres else x

    linear_total = (norm(total) - norm(-total)) / 2  # weight * centre(total) / scale(total)
    direction = weight * centred(total)
    scale = (direction * direction).sum(-1, keepdim=True) / (direction * linear_total).sum(-1, keepdim=True)
    normed: torch.Tensor = weight * centred(parts) / scale
    return normed
