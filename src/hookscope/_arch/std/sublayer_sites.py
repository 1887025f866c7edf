"""Values inside a block's sublayer, in a canonical map: a mixture of experts
(``blocks.{i}.mlp.experts.{e}.*`` and the routing) and a state-space mixer
(``blocks.{i}.mixer.*``).

Why a module of its own: a fused experts module (:mod:`~hookscope._arch.experts`) holds every
expert, so its names are not one per module but one per expert and value, read through the
experts tap (``model.layers.3.mlp.experts:expert.post#7``), and the routing is what the experts
module takes: transformers' experts interface passes ``(hidden_states, top_k_index,
top_k_weights)``, whatever the router returns first.

- ``mlp.experts.{e}.in|pre|up|post|out|tokens|weights``: expert ``e``'s rows
  (:data:`~hookscope._core.op_sites.EXPERT_KINDS`; ``up`` only for experts with a gate);
- ``mlp.router.choice``: the experts each token is routed to, ``(tokens, top_k)``;
- ``mlp.router.weights``: their routing weights, ``(tokens, top_k)``.
"""

from __future__ import annotations

from hookscope._arch.ssm import MAMBA1_KINDS
from hookscope._arch.std.observe import Seen
from hookscope._core.names import escape_name
from hookscope._core.op_sites import EXPERT_KINDS, SSM_KINDS
from hookscope._core.std_names import StdSite

__all__ = ["expert_sites", "mixer_subs"]

_ROUTING = {"choice": "[1]", "weights": "[2]"}


def expert_sites(
    sites: dict[str, StdSite],
    missing: dict[str, str],
    mlp: str,
    experts: tuple[str, int, bool] | None,
    seen: Seen,
) -> None:
    """Name the experts and the routing of the block whose MLP is called ``mlp``
    (``blocks.3.mlp``); ``experts``: its fused experts module, expert count and gate, or None."""
    if experts is None:
        return
    module, count, gated = experts
    if not seen.ran(module):
        for part in _ROUTING:
            missing[f"{mlp}.router.{part}"] = "its experts module did not run in the check forward"
        return
    written = escape_name(module)
    for part, path in _ROUTING.items():
        read = f"{written}:input{path}"
        sites[f"{mlp}.router.{part}"] = StdSite(f"{mlp}.router.{part}", read, read, None, "input")
    for expert in range(count):
        for kind in EXPERT_KINDS:
            full = f"{mlp}.experts.{expert}.{kind}"
            if kind == "up" and not gated:
                missing[full] = "its experts have no gate: the one projection before the activation is .pre"
                continue
            text = f"{written}:expert.{kind}#{expert}"
            sites[full] = StdSite(full, text, text, None, "op")


def mixer_subs(
    sites: dict[str, StdSite], missing: dict[str, str], name: str, mixer: str | None, found: str | None
) -> None:
    """Name ``{name}.{kind}`` (``blocks.3.mixer.decay``) for each value of the mixer the
    state-space tap reads (:mod:`~hookscope._arch.ssm`; ``found``: which mixer it is), or say why not."""
    not_read = {
        "variant": (
            "a Mamba variant whose arithmetic adds steps of its own (Falcon-H1's multipliers, FalconMamba's norms), "
            "which the state-space tap does not reproduce: read the mixer's submodules by name"
        ),
        "other": (
            "the mixer is no Mamba or Mamba-2 mixer (a linear attention such as a gated delta net): its values "
            "inside are not read; read its submodules by name"
        ),
    }
    for kind in SSM_KINDS:
        full = f"{name}.{kind}"
        if found not in ("mamba", "mamba2"):
            missing[full] = not_read.get(str(found), not_read["other"])
        elif kind == "state":
            missing[full] = "one state per token: select it on the mixer by position, e.g. 'MIXER:ssm.state#5'"
        elif found == "mamba" and kind not in MAMBA1_KINDS:
            missing[full] = "Mamba (version 1) decays per channel and state: no one attention matrix per head"
        else:
            text = f"{escape_name(str(mixer))}:ssm.{kind}#0"
            sites[full] = StdSite(full, text, text, None, "op")
