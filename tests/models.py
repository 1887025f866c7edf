"""The zoo: small real models with the shapes that break naive hook code.

Every model built here is remembered (weakly) so that the suite's leak check can look at each
one after every test and assert that no hook of any kind is left on any of its modules.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.demo.models import SmallCNN as _DemoCNN

BUILT: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def track(model: nn.Module) -> nn.Module:
    """Remember ``model`` for the leak check and return it."""
    BUILT.add(model)
    return model


class Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        BUILT.add(self)


class SmallCNN(_DemoCNN):
    """The demo's CNN: conv1 = Conv2d(3, 16, 3) -> ReLU -> pool -> fc."""

    def __init__(self) -> None:
        super().__init__()
        BUILT.add(self)

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(1, 3, 32, 32)


class SharedTwice(Tracked):
    """``shared`` runs twice per forward; it is also reachable as ``alias`` (same object)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.alias = self.shared
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(torch.relu(self.shared(x))))


class Looped(Tracked):
    """``block`` runs ``steps`` times in a Python loop."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.steps = steps
        self.block = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = torch.tanh(self.block(x))
        return x


class LinearInplaceReLU(Tracked):
    """Linear -> ReLU(inplace=True): the ReLU rewrites the Linear's output tensor in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


@dataclass
class Pair:
    value: torch.Tensor
    meta: int


Named = namedtuple("Named", ["hidden", "extra"])


class TupleOut(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int]:
        return x * 2, None, 3


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"a": x + 1, "b": [x - 1, "label"]}


class DataclassOut(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(x * 3, meta=7)


class NamedTupleOut(nn.Module):
    def forward(self, x: torch.Tensor) -> Named:
        return Named(hidden=x / 2, extra=None)


class NoneOut(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


class MixedOutputs(Tracked):
    """Children return tuples, dicts, dataclasses, namedtuples and None, with ints mixed in."""

    def __init__(self) -> None:
        super().__init__()
        self.tuple_out = TupleOut()
        self.dict_out = DictOut()
        self.dataclass_out = DataclassOut()
        self.named_out = NamedTupleOut()
        self.none_out = NoneOut()

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        first, _, count = self.tuple_out(x)
        mapping = self.dict_out(first)
        pair = self.dataclass_out(mapping["a"])
        named = self.named_out(pair.value)
        self.none_out(named.hidden)
        return {"out": named.hidden, "count": count, "pair": pair}


class ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x) * scale
        return out


class KeywordOnly(Tracked):
    """``block.forward(x, *, scale)`` takes a keyword-only tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ScaledBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x, scale=torch.full((1,), 2.0))
        return out


class Residual(Tracked):
    """A residual block written the torchvision way: ``out = bn(conv(x)); out += identity; relu_``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.bn(self.conv(x))
        out += identity
        return self.relu(out)

    @staticmethod
    def example() -> torch.Tensor:
        return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom: this module always fails")


class RaisesMidForward(Tracked):
    """``first`` runs, then ``boom`` raises, so ``after`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.boom = Boom()
        self.after = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.after(self.boom(self.first(x)))
        return out


class Nested(Tracked):
    """Sequential inside Sequential, a ModuleList and a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 4))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2)])
        self.heads = nn.ModuleDict({"main": nn.Linear(4, 2), "aux": nn.Linear(4, 3)})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.heads["main"](x), self.heads["aux"](x)


class RefusesHooks(nn.Linear):
    """A module that refuses forward hooks, to make an attach fail half-way."""

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module refuses forward hooks")


class HalfRefuses(Tracked):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = RefusesHooks(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c(self.b(self.a(x)))
        return out


def tiny_gpt2() -> nn.Module:
    """A 2-layer GPT-2 built from a config with random weights (nothing downloaded), in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return track(GPT2Model(config).eval())


def attention_gpt2(attn: str) -> nn.Module:
    """A 2-layer GPT-2 (vocabulary 100) with ``attn_implementation`` ``"eager"`` or ``"sdpa"``: the
    same random weights for both, so op sites of one can be checked against the other."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0, attn_implementation=attn
    )
    return track(GPT2Model(config).eval())


def attention_tokens() -> torch.Tensor:
    """Two rows of eight token ids for :func:`attention_gpt2`."""
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def tiny_resnet() -> nn.Module:
    """A 2-stage ResNet (basic blocks, whose forward does ``hidden_state += residual``), random weights."""
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    return track(ResNetModel(config).eval())


def gpt2_input() -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


ALL_SMALL = [SmallCNN, SharedTwice, Looped, LinearInplaceReLU, MixedOutputs, KeywordOnly, RaisesMidForward, Nested]


class Handshake(nn.Module):
    """Holds its first forward open until told to go on: lets a test run a second thread inside a
    pass (under torch.compile it is a graph break: it waits on a thread event). Later calls, the
    second thread's among them, go straight through."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.go_on = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inside.is_set():
            self.inside.set()
            assert self.go_on.wait(timeout=30), "the other thread never finished"
        return x * 2

    def intruder(self, call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
        """A started thread that, once this module holds a forward open, runs ``call``, keeps what
        it raised, then lets the forward go on; join it after the forward."""
        raised: list[BaseException] = []

        def intrude() -> None:
            assert self.inside.wait(timeout=30)
            try:
                call()
            except Exception as error:
                raised.append(error)
            finally:
                self.go_on.set()

        thread = threading.Thread(target=intrude)
        thread.start()
        return thread, raised
