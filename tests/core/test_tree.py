from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import pytest
import torch

from hookscope._core.tree import flatten_tensors, iter_leaves, map_tensors, map_tensors_with_paths
from tests.models import Named, Pair, gpt2_input, tiny_gpt2


def paths(value: object) -> list[str]:
    return [path for path, _ in flatten_tensors(value)]


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    note: str = "n"
    derived: int = field(init=False, default=5)


class TestFlatten:
    def test_bare_tensor(self) -> None:
        assert paths(torch.zeros(1)) == ["output"]

    def test_nested_containers_and_readable_paths(self) -> None:
        t = torch.zeros(1)
        value = (t, {"a": [t, None, 3], "b": Pair(t, 1)}, Named(hidden=t, extra="s"))
        assert paths(value) == [
            "output[0]",
            "output[1]['a'][0]",
            "output[1]['b'].value",
            "output[2].hidden",
        ]

    def test_non_tensor_leaves_listed_by_iter_leaves(self) -> None:
        assert list(iter_leaves({"n": None, "k": 2}, root="input")) == [("input['n']", None), ("input['k']", 2)]

    def test_non_string_dict_keys_use_repr(self) -> None:
        assert paths({0: torch.zeros(1), ("a", 1): torch.zeros(1)}) == ["output[0]", "output[('a', 1)]"]

    @pytest.mark.transformers
    def test_model_output_uses_attribute_paths(self) -> None:
        output = tiny_gpt2()(gpt2_input(), use_cache=False)
        assert paths(output) == ["output.last_hidden_state"]

    @pytest.mark.transformers
    def test_model_output_with_cache_and_hidden_states(self) -> None:
        output = tiny_gpt2()(gpt2_input(), output_hidden_states=True, use_cache=False)
        assert paths(output) == [
            "output.last_hidden_state",
            "output.hidden_states[0]",
            "output.hidden_states[1]",
            "output.hidden_states[2]",
        ]


class TestMap:
    def test_keeps_container_types(self) -> None:
        t = torch.ones(2)
        value = {
            "od": OrderedDict([("z", t), ("a", t)]),
            "dd": defaultdict(list, {"k": t}),
            "pair": Pair(t, 4),
            "named": Named(t, None),
            "frozen": Frozen(t),
            "list": [t, "s"],
            "size": torch.Size([2, 3]),
        }
        out = map_tensors(lambda x: x * 2, value)
        assert type(out["od"]) is OrderedDict
        assert list(out["od"]) == ["z", "a"]
        assert type(out["dd"]) is defaultdict
        assert out["dd"].default_factory is list
        assert type(out["pair"]) is Pair
        assert out["pair"].meta == 4
        assert type(out["named"]) is Named
        assert out["named"].extra is None
        assert type(out["frozen"]) is Frozen
        assert out["frozen"].derived == 5
        assert out["frozen"].note == "n"
        assert out["list"][1] == "s"
        assert out["size"] == torch.Size([2, 3])
        assert all(torch.equal(x, t * 2) for _, x in flatten_tensors(out))

    def test_does_not_mutate_the_original(self) -> None:
        t = torch.ones(1)
        value = {"a": [t], "p": Pair(t, 1)}
        map_tensors(lambda x: x + 1, value)
        assert value["a"][0] is t
        assert value["p"].value is t

    def test_paths_given_to_fn(self) -> None:
        seen: list[str] = []

        def fn(path: str, x: torch.Tensor) -> torch.Tensor:
            seen.append(path)
            return x

        map_tensors_with_paths(fn, ((torch.ones(1),), {"k": torch.ones(1)}), root="args")
        assert seen == ["args[0][0]", "args[1]['k']"]

    @pytest.mark.transformers
    def test_model_output_rebuilt_as_model_output(self) -> None:
        output = tiny_gpt2()(gpt2_input(), use_cache=False)
        out = map_tensors(torch.zeros_like, output)
        assert type(out) is type(output)
        assert torch.count_nonzero(out.last_hidden_state) == 0
        assert torch.count_nonzero(out[0]) == 0, "item and attribute stay in step"
        assert torch.count_nonzero(output.last_hidden_state) > 0

    @pytest.mark.parametrize("leaf", [None, 3, "text", 2.5, object])
    def test_non_tensor_leaves_pass_through(self, leaf: object) -> None:
        assert map_tensors(lambda x: x * 0, leaf) is leaf
