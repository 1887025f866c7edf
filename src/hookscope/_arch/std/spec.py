"""The shape of a family table: where each canonical role lives in one architecture.

A family table is data, not code: a :class:`Family` names the block lists (one per stack:
``""`` for decoder-only and encoder-only models, ``"encoder"`` and ``"decoder"`` for
encoder-decoder ones), and a :class:`Block` names, relative to one block, the module that plays
each role. The resolver (:mod:`~hookscope._arch.std.resolve`) turns roles into sites and checks
them on one forward; the structural detector (:mod:`~hookscope._arch.std.detect`) produces the
same :class:`Block` for a model no table knows. Paths are dotted module names as
``named_modules()`` spells them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Block", "Family", "Layout", "Stack"]

#: How a block adds its sublayers to the residual stream:
#: ``"pre"``: norm, sublayer, add, one after the other (GPT-2, Llama, T5, ViT, Whisper);
#: ``"post"``: sublayer, add, then norm (BERT, BART); ``"parallel"``: attention and MLP both
#: read the block's input and are added together (GPT-J, Falcon, Phi, GPT-NeoX by default).
Layout = Literal["pre", "post", "parallel"]


@dataclass(frozen=True)
class Block:
    """The role of each module of one block, as paths relative to the block (None: absent).

    Attributes:
        ln1: the attention sublayer's norm (before it in ``"pre"``, after the add in ``"post"``).
        attn: the attention module: its ``scaled_dot_product_attention`` call gives the
            ``attn.q|k|v|scores|pattern|z`` sub-sites.
        attn_out: the module whose output is what attention adds to the residual (default:
            ``attn``): a dropout after it, a post-attention norm (Gemma 2 and 3), the output
            projection where the add happens inside the attention module (BLOOM, BERT).
        ln2: the MLP sublayer's norm.
        mlp: the MLP module, if it is one module.
        mlp_out: the module whose output is what the MLP adds to the residual (default ``mlp``).
        mlp_in: where the MLP is not one module (BART's ``fc1``, ``fc2`` in the block), the module
            that reads its input: what ``ln2`` must feed (the structural detector checks it).
        act: the activation module: ``mlp.pre`` is its input.
        mlp_proj: the MLP's output projection: ``mlp.post`` is its input (for a gated MLP, the
            activation times the up projection).
        router: a mixture-of-experts router: ``mlp.router`` is the first tensor it returns.
        mixer: a state-space block's mixer (Mamba, Mamba-2), in place of attention: ``mixer`` is
            what it adds to the stream and ``mixer.z|conv|x|B|C|dt|decay|pattern|y|out`` its
            values (:mod:`~hookscope._arch.ssm`).
        cross_attn, cross_attn_out, ln_cross: the same three for a decoder's cross-attention.
        resid_mid: a module whose output is the residual stream after attention, where the
            add happens inside a module (T5's sublayers, BLOOM's attention); else the resolver
            finds the block's own add (``"pre"``) or takes ``ln1``'s output (``"post"``).
        resid_mid_cross: the same after cross-attention.
        layout: see :data:`Layout`.
        why_parallel: for ``"parallel"``, the sentence saying why ``resid_mid`` is not defined.
        norms: the structural detector's every norm of the block outside attention and the MLP
            (tables leave it empty): names alone cannot tell a norm before a sublayer from one
            after it (Llama's ``post_attention_layernorm`` feeds the MLP, OLMo 2's normalizes
            what attention adds), so :mod:`~hookscope._arch.std.place` places them by values.
    """

    ln1: str | None = None
    attn: str | None = None
    attn_out: str | None = None
    ln2: str | None = None
    mlp: str | None = None
    mlp_out: str | None = None
    mlp_in: str | None = None
    act: str | None = None
    mlp_proj: str | None = None
    router: str | None = None
    mixer: str | None = None
    cross_attn: str | None = None
    cross_attn_out: str | None = None
    ln_cross: str | None = None
    resid_mid: str | None = None
    resid_mid_cross: str | None = None
    layout: Layout = "pre"
    why_parallel: str = "attention and the MLP both read the block's input and are added together"
    norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stack:
    """One list of blocks and the modules around it, paths relative to the model's base.

    Attributes:
        prefix: the canonical prefix (``""``, ``"encoder"``, ``"decoder"``).
        blocks: the path of the block list (``"h"``, ``"layers"``, ``"encoder.layer"``);
            alternatives separated by ``|`` (renamed between transformers versions).
        block: the roles inside each block.
        embed: the token embedding (or the whole embedding of a vision model): ``embed``.
        pos_embed: a learned position embedding module, where there is one.
        ln_final: the norm after the last block.
        no_pos_embed: why there is no ``pos_embed`` (rotary, relative, inside ``embed``).
        no_embed: why there is no ``embed`` (an audio front end).
    """

    prefix: str
    blocks: str
    block: Block
    embed: str | None = None
    pos_embed: str | None = None
    ln_final: str | None = None
    no_pos_embed: str = "positions are not a module's output here (rotary or relative positions, or added inside embed)"
    no_embed: str = "the model has no token embedding module"


@dataclass(frozen=True)
class Family:
    """One architecture: the ``config.model_type`` values it covers and its stacks.

    ``unembed`` is relative to the root (the head is outside the base model); so is
    ``projector``, a vision-language model's module that takes the vision tower's tokens into
    the language model's width (``projector.in`` is what it takes, ``projector`` what it gives).
    """

    name: str
    model_types: tuple[str, ...]
    stacks: tuple[Stack, ...]
    unembed: str | None = "lm_head"
    projector: str | None = None
    #: A vision-language model (its config names an image token): ``projector`` and
    #: ``projector.in`` are named, or missing with the reason.
    vision_language: bool = False

    @property
    def detected(self) -> bool:
        """True for a table the structural detector read off a model (it has no model type)."""
        return not self.model_types
