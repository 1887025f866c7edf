"""Inside a state-space mixer: Mamba and Mamba-2 values computed from the mixer's own arguments.

A Mamba mixer's interesting values (the gates, the per-step decay, the recurrent state, and for
Mamba-2 the effective attention matrix) live inside a scan (a fused CUDA kernel, or on a CPU
transformers' chunked PyTorch reference) that no hook sees. They are functions of the mixer's
input and weights, so a *forward tap* (:func:`~hookscope._core.ops.set_forward_tap`) runs the
model's own forward, unchanged, then computes them from the same arguments, step by step:

- ``z``: the gate branch of the input projection, ``(batch, seq, d_inner)``;
- ``conv``: the causal convolution's output after its activation (Mamba-2: x, B and C side by
  side), ``(batch, seq, channels)``;
- ``x``: the scan's input, ``(batch, seq, heads, head_dim)`` (Mamba: ``(batch, seq, d_inner)``);
- ``B``, ``C``: the input and output matrices, ``(batch, seq, groups, state)`` (Mamba:
  ``(batch, seq, state)``);
- ``dt``: the time step after its bias, softplus and limits, ``(batch, seq, heads)`` (Mamba:
  ``(batch, seq, d_inner)``);
- ``decay``: the per-step decay ``exp(A * dt)``, ``(batch, seq, heads)`` (Mamba: ``(batch,
  seq, d_inner, state)``);
- ``pattern`` (Mamba-2 only): the effective attention matrix of state-space duality,
  ``L ⊙ (C Bᵀ)`` per head, ``(batch, heads, seq, seq)``, with ``L[t, s]`` the product of the
  decays after ``s`` up to ``t`` (0 above the diagonal): ``y[t] = Σ_s pattern[t, s] dt[s] x[s]
  + D x[t]``;
- ``state``: the recurrent state after token ``#t``, ``(batch, heads, head_dim, state)``
  (Mamba: ``(batch, d_inner, state)``);
- ``y``: the scan's output with the ``D`` skip, before gating, ``(batch, seq, d_inner)``;
- ``out``: what the output projection takes (Mamba-2: the gated norm of ``y``; Mamba:
  ``y * act(z)``), ``(batch, seq, d_inner)``.

Every tapped call also recomputes the mixer's output from these values and compares it with
the model's (the model's stays what the forward returns): a mixer class whose arithmetic the
tap does not reproduce (a variant with multipliers, another layout) is refused with the
difference instead of read wrongly. An edit of a value (any but ``state``) makes the rest of the
computation start from it, and the mixer returns that output instead.

What the tap cannot show: a call continuing from a cached recurrent state (one token at a time
in ``generate``), whose earlier tokens are not in its arguments; run the forward without a
cache (``use_cache=False``). Which scan the model ran does not matter (on a CPU transformers'
chunked PyTorch path; on a GPU with ``mamba_ssm`` the fused kernel): the values are recomputed
from the same arguments, in float32. Cost: the mixer's work again, a Python step per token for
the scan, and ``batch x heads x seq x seq`` values for ``pattern`` (only when selected).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from hookscope._core.names import module_label
from hookscope._core.op_mode import hookscope_work, open_frames, report_value
from hookscope._core.ops import set_forward_tap
from hookscope.errors import EditError, SpecError, UnsupportedModelError

__all__ = ["MAMBA1_KINDS", "flavour", "mixer_values", "ssm_problem", "tap_ssm"]

#: What a Mamba (version 1) mixer has: no effective attention matrix (its decay is per channel
#: and state, not per head).
MAMBA1_KINDS = ("z", "conv", "x", "B", "C", "dt", "decay", "state", "y", "out")
_MAMBA2 = ("in_proj", "conv1d", "out_proj", "A_log", "D", "dt_bias", "norm", "num_heads", "head_dim", "n_groups")
_MAMBA1 = ("in_proj", "conv1d", "out_proj", "A_log", "D", "x_proj", "dt_proj", "time_step_rank")
#: What marks a variant whose arithmetic adds steps the tap does not take (Falcon-H1's multipliers):
#: such a mixer is not read (the output check would refuse it). Jamba's RMS norms of dt, B and C
#: (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) are taken.
_VARIANTS = ("mup_vector", "ssm_multipliers", "zxbcdt_multipliers", "b_c_rms", "rms_eps")


def flavour(module: nn.Module) -> str | None:
    """``"mamba2"``, ``"mamba"`` or None: which mixer ``module`` is, by what it holds."""
    a_log = getattr(module, "A_log", None)
    if not isinstance(a_log, torch.Tensor) or any(hasattr(module, name) for name in _VARIANTS):
        return None
    if a_log.dim() == 1 and all(hasattr(module, name) for name in _MAMBA2):
        norm = getattr(module, "norm", None)  # the gated RMS norm (Falcon-H1 without mamba_rms_norm has none)
        return "mamba2" if hasattr(norm, "variance_epsilon") and hasattr(norm, "weight") else None
    if a_log.dim() == 2 and all(hasattr(module, name) for name in _MAMBA1):
        return "mamba"
    return None


def ssm_problem(module: nn.Module, name: str, kinds: set[str]) -> str | None:
    """Why state-space sub-sites ``kinds`` cannot be read at ``module`` (``name``), or None."""
    found = flavour(module)
    where = f"{module_label(name)!r} ({type(module).__name__})"
    if found is None:
        return (
            f"{where} is not a Mamba or Mamba-2 mixer (a module holding in_proj, conv1d, A_log, D and out_proj): "
            "state-space sub-sites select the mixer, e.g. 'backbone.layers.0.mixer:ssm.decay'"
        )
    if found == "mamba" and "pattern" in kinds:
        return (
            f"{where} is a Mamba (version 1) mixer, whose decay is per channel and state, not per head: it has no "
            "one attention matrix per head (ssm.pattern is Mamba-2's); read ssm.decay, ssm.B and ssm.C"
        )
    return None


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The mixer call's ``(hidden_states, attention_mask, cache)``."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    cache = args[1] if len(args) > 1 else kwargs.get("cache", kwargs.get("cache_params"))
    mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
    return hidden, mask, cache


def continues_a_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call starts from a recurrent state a cache holds (the tap cannot see it)."""
    _, _, cache = _arguments(args, kwargs)
    getter = getattr(cache, "get_recurrent_state", None)
    if cache is None or getter is None:
        return False
    try:
        return getter(getattr(module, "layer_idx", 0)) is not None
    except (IndexError, KeyError, AttributeError, TypeError):
        return False


def _masked(value: torch.Tensor, mask: Any) -> torch.Tensor:
    if mask is None:
        return value
    masked: torch.Tensor = (value * mask[:, :, None]).to(value.dtype)
    return masked


def _conv(module: Any, branch: torch.Tensor, mask: Any) -> torch.Tensor:
    """The causal depthwise convolution and its activation, ``(batch, seq, channels)``."""
    conv: nn.Conv1d = module.conv1d
    seq = branch.size(1)
    out = functional.conv1d(
        branch.transpose(1, 2).to(conv.weight.dtype),
        conv.weight,
        conv.bias,
        padding=conv.kernel_size[0] - 1,
        groups=branch.size(-1),
    )[..., :seq]
    activated = module.act(out) if hasattr(module, "act") else functional.silu(out)
    return _masked(activated.transpose(1, 2).to(branch.dtype), mask)


class _Steps:
    """Hands each value on (``report(kind, index, value)`` returns what to go on with) and
    remembers whether any was replaced."""

    def __init__(
        self, report: Callable[[str, int, torch.Tensor], Any], wants: Callable[[str, int], bool], kinds: set[str]
    ) -> None:
        self._report, self.wants, self.kinds = report, wants, kinds
        self.edited = False
        self._positions: dict[int, list[int]] = {}

    def __call__(self, kind: str, value: torch.Tensor) -> torch.Tensor:
        if kind not in self.kinds:
            return value
        got: object = self._report(kind, 0, value)
        if got is value:
            return value
        if not isinstance(got, torch.Tensor) or got.shape != value.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise EditError(f"ssm.{kind} was replaced by {shape}, expected {tuple(value.shape)}")
        self.edited = True
        return got.to(value.dtype)

    def report(self, kind: str, index: int, value: torch.Tensor) -> object:
        """Hand on a value that cannot be replaced (the caller refuses a replacement)."""
        return self._report(kind, index, value)

    def positions(self, seq: int) -> list[int]:
        """The tokens whose recurrent state is asked for (found once per length)."""
        if "state" not in self.kinds:
            return []
        if seq not in self._positions:
            self._positions[seq] = [t for t in range(seq) if self.wants("state", t)]
        return self._positions[seq]


def mixer_values(
    module: nn.Module, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], steps: _Steps
) -> torch.Tensor:
    """Compute the values of a mixer of ``kind`` (:func:`flavour`, read once when tapped) from
    its call's arguments, handing each on (``steps``), and return the mixer's output recomputed
    from them (from an edited value onwards where one was)."""
    hidden, mask, _ = _arguments(args, kwargs)
    if kind == "mamba2":
        return _mamba2(module, hidden, mask, steps)
    return _mamba(module, hidden, mask, steps)


def _mamba2(m: Any, hidden: torch.Tensor, mask: Any, step: _Steps) -> torch.Tensor:
    dtype = hidden.dtype
    batch, seq, _ = hidden.shape
    heads, head_dim, groups = int(m.num_heads), int(m.head_dim), int(m.n_groups)
    inner, state_size = heads * head_dim, int(m.ssm_state_size)
    projected = functional.linear(_masked(hidden, mask), m.in_proj.weight, m.in_proj.bias)
    z, branch, dt_raw = torch.split(projected, [inner, projected.size(-1) - inner - heads, heads], dim=-1)
    z = step("z", z)
    conv = step("conv", _conv(m, branch, mask))
    x, b, c = torch.split(conv, [inner, groups * state_size, groups * state_size], dim=-1)
    x = step("x", x.reshape(batch, seq, heads, head_dim)).float()
    b = step("B", b.reshape(batch, seq, groups, state_size)).float()
    c = step("C", c.reshape(batch, seq, groups, state_size)).float()
    limit = getattr(m, "time_step_limit", (0.0, float("inf")))
    dt = functional.softplus(dt_raw + m.dt_bias.to(dt_raw.dtype)).clamp(min=limit[0], max=limit[1])
    dt = step("dt", dt).float()
    a = -torch.exp(m.A_log.float())
    decay = step("decay", torch.exp(a * dt))
    b_heads = b.repeat_interleave(heads // groups, dim=2)
    c_heads = c.repeat_interleave(heads // groups, dim=2)
    stepped = x * dt[..., None]  # dt[s] x[s], (batch, seq, heads, head_dim)
    given = None
    if "pattern" in step.kinds:
        computed = _ssd_pattern(decay, b_heads, c_heads)
        given = step("pattern", computed)
        given = None if given is computed else given
    scanned = None
    if given is None or step.positions(seq):  # h[t] = decay[t] h[t-1] + (dt x)[t] B[t]; y[t] = h[t] C[t]
        scanned = _recurrence(
            stepped.new_zeros(batch, heads, head_dim, state_size),
            seq,
            lambda t, h: decay[:, t, :, None, None] * h + stepped[:, t, :, :, None] * b_heads[:, t, :, None, :],
            lambda t, h: torch.einsum("bhpn,bhn->bhp", h, c_heads[:, t]),
            step,
        )
    y = torch.einsum("bhts,bshp->bthp", given, stepped) if given is not None else scanned
    assert y is not None
    y = y + m.D.float()[:, None] * x
    y = step("y", y.reshape(batch, seq, inner))
    out = step("out", _gated_norm(m.norm, y, z))
    return functional.linear(out.to(dtype), m.out_proj.weight, m.out_proj.bias)


def _ssd_pattern(decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``L ⊙ (C Bᵀ)`` per head, ``(batch, heads, seq, seq)``: ``L[t, s]`` is the product of the
    decays after ``s`` up to ``t``, summed as logs under a mask (a decay of 0, log -inf, cuts
    the past off; no difference of infinities), 0 above the diagonal."""
    logs = torch.log(decay).permute(0, 2, 1)  # (batch, heads, seq)
    seq = logs.size(-1)
    expanded = logs[..., None].expand(*logs.shape, seq)  # [..., r, s] = log decay[r]
    later = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=logs.device), diagonal=-1)  # r > s
    summed = torch.cumsum(expanded.masked_fill(~later, 0.0), dim=-2)  # [..., t, s] = sum over s < r <= t
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=logs.device))
    decays = torch.exp(summed.masked_fill(~causal, -torch.inf))
    return torch.einsum("bthn,bshn->bhts", c, b) * decays


def _recurrence(
    state: torch.Tensor,
    seq: int,
    advance: Callable[[int, torch.Tensor], torch.Tensor],
    read: Callable[[int, torch.Tensor], torch.Tensor],
    step: _Steps,
) -> torch.Tensor:
    """The scan token by token: ``state = advance(t, state)``, then ``read(t, state)`` is token
    ``t``'s output (stacked along dim 1); hands on the states asked for."""
    positions = set(step.positions(seq))
    outputs = []
    for t in range(seq):
        state = advance(t, state)
        if t in positions:
            _read_only(step, t, state)
        outputs.append(read(t, state))
    return torch.stack(outputs, dim=1)


def _read_only(step: _Steps, position: int, state: torch.Tensor) -> None:
    got = step.report("state", position, state)
    if got is not state:
        raise EditError(
            f"ssm.state#{position} is read only: an edit of the recurrent state would need the scan run again from "
            "that token; edit ssm.decay, ssm.B, ssm.C, ssm.x or ssm.dt instead (they feed every later state)"
        )


def _normalized(value: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, in float32: an RMS norm before its weight."""
    wide = value.float()
    return wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)


def _rms(norm: Any, value: torch.Tensor) -> torch.Tensor:
    """An RMS norm module's arithmetic, without calling the module (its hooks saw the model's call)."""
    weighted: torch.Tensor = norm.weight * _normalized(value, norm.variance_epsilon).to(value.dtype)
    return weighted


def _gated_norm(norm: Any, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Mamba-2's gated RMS norm: ``y * silu(z)`` normalised per group, times the weight."""
    gated = y.float() * functional.silu(z.float())
    group = int(getattr(norm, "group_size", gated.size(-1)))
    normed = _normalized(gated.view(*gated.shape[:-1], gated.size(-1) // group, group), norm.variance_epsilon)
    weighted: torch.Tensor = norm.weight * normed.view(gated.shape).to(y.dtype)
    return weighted


def _mamba(m: Any, hidden: torch.Tensor, mask: Any, step: _Steps) -> torch.Tensor:
    dtype = hidden.dtype
    batch, seq, _ = hidden.shape
    projected = functional.linear(_masked(hidden, mask), m.in_proj.weight, m.in_proj.bias)
    branch, z = projected.chunk(2, dim=-1)
    z = step("z", z)
    conv = step("conv", _conv(m, branch, mask))
    x = step("x", conv).float()
    rank, state_size = int(m.time_step_rank), int(m.ssm_state_size)
    time_step, b, c = torch.split(
        functional.linear(x.to(m.x_proj.weight.dtype), m.x_proj.weight), [rank, state_size, state_size], dim=-1
    )
    if getattr(m, "dt_layernorm", None) is not None:  # Jamba: RMS norms of dt, B and C before the scan
        time_step, b, c = _rms(m.dt_layernorm, time_step), _rms(m.b_layernorm, b), _rms(m.c_layernorm, c)
    b, c = step("B", b).float(), step("C", c).float()
    dt = functional.softplus(time_step @ m.dt_proj.weight.T + m.dt_proj.bias)
    dt = step("dt", dt).float()
    a = -torch.exp(m.A_log.float())
    decay = step("decay", torch.exp(a[None, None] * dt[..., None]))  # (batch, seq, d_inner, state)
    scanned = _recurrence(
        x.new_zeros(batch, x.size(-1), state_size),
        seq,
        lambda t, h: decay[:, t] * h + (dt[:, t, :, None] * b[:, t, None, :]) * x[:, t, :, None],
        lambda t, h: torch.einsum("bdn,bn->bd", h, c[:, t]),
        step,
    )
    y = scanned + m.D.float() * x
    y = step("y", y)
    activation = m.act if hasattr(m, "act") else functional.silu
    out = step("out", y * activation(z.float()))
    return functional.linear(out.to(dtype), m.out_proj.weight, m.out_proj.bias)


# -- the tap: which mixers are read, and the forward that reads them ---------------------------------

_LOCK = threading.Lock()


class _Mixer:
    """One tapped mixer: which it is (read once, at the tap) and what its taps ask for, the
    union kept current as taps come and go."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: list[tuple[frozenset[str], Callable[[str, int], bool]]] = []
        self.kinds: set[str] = set()

    def update(self) -> None:
        self.kinds = {kind for kinds, _ in self.entries for kind in kinds}

    def wants(self, kind: str, index: int) -> bool:
        return any(kind in kinds and want(kind, index) for kinds, want in self.entries)


_MIXERS: dict[int, _Mixer] = {}


def tap_ssm(module: nn.Module, kinds: frozenset[str], wants: Callable[[str, int], bool]) -> Callable[[], None]:
    """Read ``module``'s values ``kinds`` (``ssm.state`` at the positions ``wants("state", t)``
    accepts) on every call an op watch sees; returns the removal (taps of several features on
    one mixer add up)."""
    entry = (kinds, wants)
    found = flavour(module)
    if found is None:  # refused by the caller already
        raise SpecError(f"{type(module).__name__} is not a Mamba or Mamba-2 mixer")
    with _LOCK:
        mixer = _MIXERS.setdefault(id(module), _Mixer(found))
        mixer.entries.append(entry)
        mixer.update()
        set_forward_tap(module, _tap)
    removed = False

    def remove() -> None:
        nonlocal removed
        with _LOCK:
            if removed:
                return
            removed = True
            if entry in mixer.entries:
                mixer.entries.remove(entry)
            mixer.update()
            if not mixer.entries:
                _MIXERS.pop(id(module), None)
                set_forward_tap(module, None)

    return remove


def _tap(module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The mixer's forward, then its values from the same arguments (module docstring)."""
    if continues_a_cache(module, args, kwargs):
        raise UnsupportedModelError(
            f"{type(module).__name__} continues from a recurrent state held in the cache (one token at a time, as in "
            "generate): state-space sub-sites are computed from a call's own arguments, which lack the earlier "
            "tokens; run the whole sequence in one forward without a cache (use_cache=False)"
        )
    output = forward(*args, **kwargs)
    mixer = _MIXERS.get(id(module))
    if mixer is None:  # taken off while the forward ran
        return output
    frames = open_frames(module)
    steps = _Steps(
        lambda kind, index, value: report_value(frames, f"ssm.{kind}", index, value), mixer.wants, mixer.kinds
    )
    with hookscope_work():
        recomputed = mixer_values(module, mixer.kind, args, kwargs, steps)
        # an edited call is checked too, on the values without the edit (handed to no one)
        plain = (
            mixer_values(module, mixer.kind, args, kwargs, _Steps(_unread, _none, set()))
            if steps.edited
            else recomputed
        )
    if isinstance(output, torch.Tensor) and not _close(plain, output):
        difference = float((plain.detach().float() - output.detach().float()).abs().max())
        raise UnsupportedModelError(
            f"hookscope's reading of {type(module).__name__} does not reproduce its output (largest difference "
            f"{difference:.3g}): its arithmetic is not Mamba's or Mamba-2's as transformers writes it, or a hook "
            "inside it (an edit of one of its submodules) changes what it returns, so its state-space sub-sites "
            "would be wrong and an edit of them would drop that change; select its submodules' values instead"
        )
    return recomputed if steps.edited else output


def _unread(kind: str, index: int, value: torch.Tensor) -> torch.Tensor:
    return value


def _none(kind: str, index: int) -> bool:
    return False


def _close(recomputed: torch.Tensor, output: torch.Tensor) -> bool:
    """Equal within rounding, relative to the output's scale: one host synchronisation."""
    if recomputed.shape != output.shape:
        return False
    if not output.numel():
        return True
    low = output.dtype in (torch.float16, torch.bfloat16)
    got, want = recomputed.detach().float(), output.detach().float()
    atol = (1e-2 if low else 1e-4) * want.abs().amax() + 1e-6  # a tensor: no read of the scale on its own
    return bool(((got - want).abs() <= atol + (1e-2 if low else 1e-3) * want.abs()).all())
