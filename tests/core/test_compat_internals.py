"""The private ``nn.Module`` and ``Tensor`` attributes hookscope reads: each accessor in
``_core/compat/internals.py`` against the behaviour it stands for, and no other module reading them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._core.compat import internals

# Attributes of torch's objects read through compat only; text in docstrings and messages aside.
PRIVATE_ATTRIBUTES = {
    "_version",
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_modules",
    "_parameters",
    "_buffers",
    "_call_impl",
    "_compiled_call_impl",
    "_wrapped_call_impl",
    "_orig_mod",
}


def test_the_version_counter_moves_with_each_in_place_write_and_inference_tensors_have_none() -> None:
    tensor = torch.zeros(3)
    before = internals.version_counter(tensor)
    tensor.add_(1)
    tensor[0] = 5
    assert internals.version_counter(tensor) == before + 2  # type: ignore[operator]
    with torch.inference_mode():
        assert internals.version_counter(torch.zeros(3)) is None


def test_dataparallel_replicas_share_their_original_s_hook_dicts_key() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    replicas = [model._replicate_for_data_parallel() for _ in range(2)]  # what nn.parallel.replicate makes
    assert all(internals.hook_dicts_key(replica) == internals.hook_dicts_key(model) for replica in replicas)
    assert internals.hook_dicts_key(model[0]) != internals.hook_dicts_key(model)
    assert internals.hook_dicts_key(nn.Linear(2, 2)) != internals.hook_dicts_key(nn.Linear(2, 2))


def test_child_slots_list_a_child_under_each_attribute_and_empty_slots() -> None:
    model = nn.Module()
    shared = nn.Linear(2, 2)
    model.first = shared
    model.again = shared
    model.register_module("empty", None)
    assert list(internals.child_slots(model)) == [("first", shared), ("again", shared), ("empty", None)]
    assert [name for name, _ in model.named_children()] == ["first"]  # what torch's public walk gives


def test_a_module_s_call_runs_the_instance_call_impl_attribute() -> None:
    assert internals.calls_look_up_call_impl()
    model = nn.Linear(2, 2)
    seen: list[str] = []
    inner = getattr(model, internals.CALL_IMPL)

    def wrapped(*args: object, **kwargs: object) -> object:
        seen.append("call")
        return inner(*args, **kwargs)

    setattr(model, internals.CALL_IMPL, wrapped)
    model(torch.ones(1, 2))
    assert seen == ["call"]
    assert hasattr(nn.Module, internals.COMPILED_CALL_IMPL) or hasattr(model, internals.COMPILED_CALL_IMPL)


@pytest.mark.compile
def test_the_compile_wrapper_keeps_the_model_under_its_attribute() -> None:
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    assert getattr(compiled, internals.COMPILED_MODEL_ATTRIBUTE) is model


def test_no_module_but_compat_reads_private_module_or_tensor_attributes() -> None:
    """An attribute of anything but ``self`` named in :data:`PRIVATE_ATTRIBUTES`, or a string of such a
    name (a ``getattr``), appears in ``_core/compat/`` only."""
    package = Path(hs.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if _has_docstring(node)}  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
                own = isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", "hookscope"}
                if not own:
                    found.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES and id(node) not in docstrings:
                found.append(f"{path.relative_to(package)}:{node.lineno}: {node.value!r}")
    assert found == [], "\n".join(found)


def _has_docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", None)
    return (
        isinstance(body, list)
        and bool(body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
