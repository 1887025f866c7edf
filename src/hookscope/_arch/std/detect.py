"""The structural detector: a family table read off a model no table knows.

It finds the block list (a ``ModuleList`` or ``Sequential`` of one class whose blocks hold an
attention module), then names each role inside a block by what the modules are: an attention
module by its class or attribute name (``attn``, ``attention``), the MLP (``mlp``, ``ffn``,
``feed_forward``, ``experts``), the norms (classes named ``*Norm*``) in the order they are
registered, the MLP's activation and its last linear layer; around the blocks, the largest
embedding, a position embedding, the last norm and a head whose width is the vocabulary.

Where the values flow is not guessed: the resolver checks the proposal on one forward (the
residual identities of :mod:`~hookscope._arch.std.resolve`), read both as pre-norm and as
post-norm blocks, keeping the reading that places more names; a role the detector could not
place is a missing name with the reason.
"""

from __future__ import annotations

import re

from torch import nn

from hookscope._arch.samples.multimodal import image_token
from hookscope._arch.std.spec import Block, Family, Stack
from hookscope._core.names import named_modules
from hookscope.errors import StdMapError

__all__ = ["detect_family"]

_ATTENTION = re.compile(r"attn|attention", re.IGNORECASE)
_CROSS = re.compile(r"cross|encoder_attn|encdec", re.IGNORECASE)
_MLP = re.compile(r"mlp|ffn|feed_?forward|moe|experts", re.IGNORECASE)
_ACT = re.compile(r"act|gelu|relu|silu|swish|tanh|sigmoid|activation", re.IGNORECASE)
_EXPERTS = re.compile(r"^experts?$|^moe$|^sparse_moe$", re.IGNORECASE)
_ROUTER = re.compile(r"^(gate|router)\b|Router|TopK", re.IGNORECASE)
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.LeakyReLU)


def detect_family(model: nn.Module) -> Family:
    """A :class:`Family` for ``model`` from its structure (see the module docstring), with
    blocks read as pre-norm until the resolver tries both readings; a model without a block list
    is a ``StdMapError`` saying so."""
    named = named_modules(model)
    lists = _block_lists(named)
    if not lists:
        raise StdMapError(
            f"no block list in this {type(model).__name__}: canonical names need a ModuleList or Sequential of "
            f"blocks of one class, each holding an attention module (a class or attribute named attn/attention); "
            f"{_why_no_blocks(named)}",
            family="detected",
            check="no block list",
        )
    images = image_token(getattr(model, "config", None)) is not None  # a vision-language model: vision and text
    prefixes = _prefixes(lists, vision_first=images)
    stacks = tuple(
        _stack(_tower(named, path, lists), path, prefix) for path, prefix in zip(lists, prefixes, strict=True)
    )
    language = images and any(s.prefix == "vision" for s in stacks)
    projector = _projector(named, lists) if language else None
    return Family("detected", (), stacks, unembed=_unembed(named, lists), projector=projector, vision_language=language)


_PROJECTOR = re.compile(r"^(multi_modal_projector|mm_projector|connector|merger|projector)$")


def _projector(named: list[tuple[str, nn.Module]], lists: list[str]) -> str | None:
    """A vision-language model's projector: the outermost module named so outside every block list."""
    found = [n for n, _ in named if _PROJECTOR.match(n.rsplit(".", 1)[-1]) and not _under(n, lists)]
    return _outermost(found)[0] if found else None


_NORM = re.compile(r"Norm(Gated|alization)?(\dd)?$")


def _is_norm(module: nn.Module) -> bool:
    """A norm by class: ``LlamaRMSNorm``, ``T5LayerNorm``; not ``RobertaPreLayerNormAttention``."""
    return bool(_NORM.search(type(module).__name__)) or isinstance(module, (nn.LayerNorm, nn.GroupNorm))


def _has_weights(module: nn.Module) -> bool:
    """A sublayer holds weights: a dropout, a norm or an activation named after one
    (``post_attention_dropout``, ``post_mlp_layernorm``) is not the sublayer."""
    return not _is_norm(module) and next(module.parameters(), None) is not None


def _is_attention(name: str, module: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return bool(_ATTENTION.search(leaf) or _ATTENTION.search(type(module).__name__)) and _has_weights(module)


def _block_lists(named: list[tuple[str, nn.Module]]) -> list[str]:
    """The paths of the lists of blocks, outermost first; a list inside a block is not one."""
    found: list[str] = []
    for name, module in named:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        children = list(module)
        if len({type(child) for child in children}) != 1:
            continue
        first = f"{name}.0" if name else "0"
        inside = [(n, m) for n, m in named if n.startswith(first + ".")]
        if any(_is_attention(n, m) for n, m in inside):
            found.append(name)
    return found


def _why_no_blocks(named: list[tuple[str, nn.Module]]) -> str:
    """What the model has instead of attention blocks, and how to read it: the longest list of
    modules says it (a state-space model's mixers, a hybrid's mixed layers, a conv net's stages)."""
    lists = [(n, m) for n, m in named if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    if not lists:
        return "it has no list of layers: select its modules by name (hs.layers(model) lists them)"
    path, longest = max(lists, key=lambda item: len(item[1]))
    classes = list(dict.fromkeys(type(child).__name__ for child in longest))
    reads = f"select them by name instead: hs.capture(model, '{path}.*') reads every layer's output"
    if len(classes) > 1:
        hybrid = "; a hybrid of attention and other mixers" if any(_is_attention(n, m) for n, m in named) else ""
        return f"its longest layer list {path!r} mixes classes {', '.join(classes)}{hybrid}; {reads}"
    first = f"{path}.0" if path else "0"
    if _is_attention(first, longest[0]):
        return (
            f"its layer list {path!r} holds the attention modules themselves ({classes[0]}), apart from the rest of "
            f"each layer: there is no block module to read; {reads}"
        )
    parts = [n.rsplit(".", 1)[-1] for n, _ in named if n.rpartition(".")[0] == first]
    if any(re.search(r"mixer|ssm|mamba|rnn|lstm|rwkv", p, re.IGNORECASE) for p in parts):
        kind = " (state-space or recurrent mixers)"
    elif any(isinstance(m, (nn.Conv1d, nn.Conv2d)) for n, m in named if n.startswith(first + ".")):
        kind = " (convolutions)"
    else:
        kind = ""
    return (
        f"its longest layer list {path!r} holds {classes[0]} layers with {', '.join(parts) or 'no submodules'} and no "
        f"attention{kind}; {reads}"
    )


def _tower(named: list[tuple[str, nn.Module]], path: str, lists: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules of the block list's own tower: under its outermost ancestor that holds no
    other block list (``vision_model`` beside ``text_model``), so that one stack's embedding
    or final norm is never another's; every module for a model of one stack."""
    parts = path.split(".")
    for depth in range(len(parts)):
        scope = ".".join(parts[:depth])
        if not any(other != path and (not scope or _under(other, [scope])) for other in lists):
            return [(n, m) for n, m in named if not scope or _under(n, [scope])]
    return named


#: The words of a block list's path that name its stack (a vision-language model's language model
#: is its text stack, Qwen2-VL's ``visual`` its vision tower).
_STACK_WORDS = {
    "encoder": ("encoder",),
    "decoder": ("decoder",),
    "text": ("text", "language"),
    "vision": ("vision", "visual"),
}


def _prefixes(lists: list[str], *, vision_first: bool = False) -> list[str]:
    """One canonical prefix per block list, told apart by a word of its path (a dotted or
    underscored part): ``encoder`` and ``decoder`` first, else ``text`` and ``vision`` (two
    towers, each with an ``encoder``); ``vision_first``, a vision-language model's vision tower
    and language model, ``vision`` and ``text`` first."""
    if len(lists) == 1:
        return [""]

    def named(path: str, order: tuple[str, ...]) -> str | None:
        parts = set(re.split(r"[._]", path.lower()))
        return next((w for w in order if parts & set(_STACK_WORDS[w])), None)

    orders = [("encoder", "decoder", "text", "vision"), ("vision", "text", "decoder", "encoder")]
    for words in reversed(orders) if vision_first else orders:
        found = [named(path, words) for path in lists]
        if None not in found and len(set(found)) == len(found):
            return [w for w in found if w is not None]
    raise StdMapError(
        f"several block lists ({', '.join(map(repr, lists))}) and no one word (encoder/decoder, text/vision) tells "
        "them apart: the detector cannot name the stacks; select their blocks by name, e.g. "
        f"hs.capture(model, '{lists[0]}.*')",
        family="detected",
        check="several block lists",
    )


def _relative(block: str, name: str) -> str:
    return name[len(block) + 1 :]


def _outermost(found: list[str]) -> list[str]:
    return [name for name in found if not any(name != other and name.startswith(other + ".") for other in found)]


def _stack(named: list[tuple[str, nn.Module]], path: str, prefix: str) -> Stack:
    block = f"{path}.0" if path else "0"
    inside = [(n, m) for n, m in named if n.startswith(block + ".")]
    attention = _outermost([n for n, m in inside if _is_attention(n, m)])
    attn = next((n for n in attention if not _CROSS.search(n.rsplit(".", 1)[-1])), None)
    cross = next((n for n in attention if n != attn and _CROSS.search(n.rsplit(".", 1)[-1])), None)
    within = [a for a in (attn, cross) if a]
    mlps = _outermost(
        [
            n
            for n, m in inside
            if _MLP.search(n.rsplit(".", 1)[-1] + type(m).__name__) and _has_weights(m) and not _under(n, within)
        ]
    )
    mlp = mlps[0] if mlps else None
    norms = [n for n, m in inside if _is_norm(m) and not _under(n, [*within, *mlps])]
    ln1 = norms[0] if norms else None
    ln_cross = norms[1] if cross and len(norms) >= 3 else None
    ln2 = norms[-1] if len(norms) >= 2 else None
    act = proj = router = mlp_in = None
    in_mlp = [(n, m) for n, m in inside if mlp is not None and n.startswith(mlp + ".")]
    if any(_EXPERTS.search(n.rsplit(".", 1)[-1]) or "Expert" in type(m).__name__ for n, m in in_mlp):
        # a mixture of experts: each token's hidden runs in its own experts, so there is no one
        # value before or after the activation; the router is the gate beside the experts
        router = next(
            (
                n
                for n, m in in_mlp
                if n.rpartition(".")[0] == mlp and _ROUTER.search(n.rsplit(".", 1)[-1] + " " + type(m).__name__)
            ),
            None,
        )
    elif in_mlp:
        act = next((n for n, m in in_mlp if _is_activation(m)), None)
        linears = [n for n, m in in_mlp if _is_linear(m)]
        proj = linears[-1] if linears else None
    loose = [n for n, m in inside if n.rpartition(".")[0] == block and _is_linear(m)] if mlp is None else []
    if len(loose) >= 2:  # an MLP of layers in the block itself (BART's fc1, activation_fn, fc2)
        mlp_in, proj = loose[0], loose[-1]
        act = next((n for n, m in inside if n.rpartition(".")[0] == block and _is_activation(m)), None)

    def rel(name: str | None) -> str | None:
        return _relative(block, name) if name else None

    roles = Block(
        ln1=rel(ln1),
        attn=rel(attn),
        ln2=rel(ln2),
        mlp=rel(mlp),
        act=rel(act),
        mlp_proj=rel(proj),
        mlp_in=rel(mlp_in),
        mlp_out=rel(proj) if mlp_in else None,
        router=rel(router),
        cross_attn=rel(cross),
        ln_cross=rel(ln_cross),
        norms=tuple(_relative(block, n) for n in norms),
    )
    embed, pos_embed = _embeddings(named, path)
    return Stack(prefix, path, roles, embed=embed, pos_embed=pos_embed, ln_final=_final_norm(named, path))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, _ACTIVATIONS) or bool(_ACT.search(type(module).__name__))


def _under(name: str, parents: list[str]) -> bool:
    return any(name == parent or name.startswith(parent + ".") for parent in parents)


def _embeddings(named: list[tuple[str, nn.Module]], path: str) -> tuple[str | None, str | None]:
    """The largest embedding before the blocks, and one named for positions; a vision tower's
    patch embedding module (patches plus positions) where there is no token embedding."""
    before: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if name == path:
            break
        before.append((name, module))
    tables = [(n, m) for n, m in before if isinstance(m, nn.Embedding)]
    positions = [n for n, _ in tables if re.search(r"pos|wpe", n.rsplit(".", 1)[-1], re.IGNORECASE)]
    tokens = sorted((m.num_embeddings, n) for n, m in tables if n not in positions)
    position = positions[0] if positions else None
    if tokens:
        return tokens[-1][1], position
    patches = _outermost([n for n, _ in before if _PATCHES.match(n.rsplit(".", 1)[-1])])
    return (patches[0] if patches else None), position


_PATCHES = re.compile(r"^(embeddings|patch_embed|patch_embedding)$")


def _final_norm(named: list[tuple[str, nn.Module]], path: str) -> str | None:
    """The first norm registered after the block list, outside it."""
    seen = False
    for name, module in named:
        if name == path:
            seen = True
            continue
        if seen and not name.startswith(path + ".") and _is_norm(module):
            return name
    return None


def _unembed(named: list[tuple[str, nn.Module]], lists: list[str]) -> str | None:
    """A linear head outside the blocks as wide as the largest embedding's vocabulary."""
    vocab = max((m.num_embeddings for _, m in named if isinstance(m, nn.Embedding)), default=None)
    for name, module in reversed(named):
        if isinstance(module, nn.Linear) and module.out_features == vocab and not _under(name, lists):
            return name
    return None
