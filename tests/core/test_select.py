from __future__ import annotations

import fnmatch
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope as hs
from hookscope._core.select import compile_selector, ensure_module, select
from tests.models import Nested, SharedTwice, SmallCNN, tiny_gpt2, track


def names(model: nn.Module, selector: hs.Selector) -> list[str]:
    return [name for name, _ in select(model, selector)]


def gpt2_lm_head() -> nn.Module:
    """GPT-2 with its language-model head: every block is named ``transformer.h.N`` (random weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    return track(GPT2LMHeadModel(config))


def _reference_match(selector: str, name: str) -> bool:
    """The selector forms by the standard library alone: a full regex match, or fnmatch's glob."""
    if selector.startswith("re:"):
        return re.fullmatch(selector[3:], name) is not None
    return fnmatch.fnmatchcase(name, selector)


class TestForms:
    def test_exact_name_and_root(self) -> None:
        model = Nested()
        assert names(model, "stem.0.1") == ["stem.0.1"]
        assert names(model, "") == [""]

    def test_glob_crosses_dots_and_keeps_model_order(self) -> None:
        model = Nested()
        assert names(model, "blocks.*") == [
            "blocks.0",
            "blocks.0.0",
            "blocks.0.1",
            "blocks.1",
            "blocks.1.0",
            "blocks.1.1",
        ]
        assert names(model, "blocks.?.0") == ["blocks.0.0", "blocks.1.0"]
        assert names(model, "heads.[am]*") == ["heads.main", "heads.aux"]

    def test_patterns_never_match_the_root(self) -> None:
        model = SmallCNN()
        assert "" not in names(model, "*")
        assert "" not in names(model, "re:.*")
        assert names(model, "*") == ["conv1", "relu", "pool", "fc"]

    def test_regex_is_a_full_match(self) -> None:
        model = Nested()
        assert names(model, r"re:blocks\.\d") == ["blocks.0", "blocks.1"]
        assert names(model, r"re:heads\..*") == ["heads.main", "heads.aux"]

    def test_class_matches_instances_including_root(self) -> None:
        model = Nested()
        assert names(model, nn.GELU) == ["blocks.0.1", "blocks.1.1"]
        assert names(model, Nested) == [""]
        assert names(model, nn.Sequential) == ["stem", "stem.0", "blocks.0", "blocks.1"]

    def test_module_object_matches_by_identity(self) -> None:
        model = Nested()
        assert names(model, model.heads["aux"]) == ["heads.aux"]

    def test_predicate_gets_name_and_module(self) -> None:
        model = Nested()
        seen: list[tuple[str, str]] = []

        def is_wide(name: str, module: nn.Module) -> bool:
            seen.append((name, type(module).__name__))
            return isinstance(module, nn.Linear) and module.out_features == 8

        assert names(model, is_wide) == ["stem.0.0"]
        assert seen[0] == ("", "Nested")

    def test_list_is_union_in_model_order_without_duplicates(self) -> None:
        model = Nested()
        assert names(model, ["heads.aux", nn.GELU, "stem", "blocks.0.1"]) == [
            "stem",
            "blocks.0.1",
            "blocks.1.1",
            "heads.aux",
        ]
        assert names(model, ("heads.aux", "stem")) == ["stem", "heads.aux"]
        assert names(model, {"heads.aux", "stem"}) == ["stem", "heads.aux"]

    def test_shared_module_listed_once_under_its_first_name(self) -> None:
        model = SharedTwice()
        assert names(model, nn.Linear) == ["shared", "head"]
        assert names(model, model.alias) == ["shared"]

    def test_compiled_predicate(self) -> None:
        predicate = compile_selector(["fc", "re:conv[0-9]"])
        assert predicate("conv1", nn.Identity())
        assert predicate("fc", nn.Identity())
        assert not predicate("conv", nn.Identity())

    @pytest.mark.transformers
    def test_gpt2_blocks(self) -> None:
        model = tiny_gpt2()
        assert names(model, "h.*.mlp") == ["h.0.mlp", "h.1.mlp"]
        assert names(model, r"re:h\.\d+\.attn") == ["h.0.attn", "h.1.attn"]
        assert len(names(model, nn.LayerNorm)) == 5  # ln_1, ln_2 per block, ln_f


class TestNoMatch:
    @pytest.mark.transformers
    def test_typo_in_glob_suggests_corrected_pattern(self) -> None:
        model = tiny_gpt2()
        n = len(list(model.named_modules()))
        with pytest.raises(hs.SelectionError, match=re.escape(f"matched 0 of {n} modules; did you mean 'h.*.mlp'")):
            select(model, "h.*.mpl")

    @pytest.mark.transformers
    @pytest.mark.parametrize(
        ("selector", "suggested"),
        [
            ("h.*.mlp", "transformer.h.*.mlp"),  # written for the inner GPT2Model
            ("h.?.attn", "transformer.h.?.attn"),
            ("transformer.h.*.mpl", "transformer.h.*.mlp"),
            ("*.mpl", "*.mlp"),
            ("h.*.mpl", "transformer.h.*.mlp"),  # both at once
            (r"re:h\.\d+\.mlp", r"re:transformer\.h\.\d+\.mlp"),
            (r"re:transformer\.h\.\d+\.mpl", r"re:transformer\.h\.\d+\.mlp"),
            (r"re:.*mpl", r"re:.*mlp"),
        ],
    )
    def test_a_pattern_that_misses_gets_the_corrected_pattern(self, selector: str, suggested: str) -> None:
        model = gpt2_lm_head()
        with pytest.raises(hs.SelectionError, match=re.escape(f"did you mean {suggested!r}?")) as info:
            select(model, selector)
        assert info.value.suggestions == (suggested,)
        wanted = [name for name, _ in model.named_modules() if name and _reference_match(suggested, name)]
        assert wanted
        assert names(model, suggested) == wanted  # the suggestion selects what it says, nothing else

    @pytest.mark.transformers
    def test_a_pattern_for_the_outer_model_loses_its_extra_names(self) -> None:
        # tiny_gpt2() is the bare GPT2Model: its blocks are "h.N"
        for selector, suggested in [(r"re:transformer\.h\.\d+", r"re:h\.\d+"), ("transformer.h.*.mlp", "h.*.mlp")]:
            with pytest.raises(hs.SelectionError, match=re.escape(f"did you mean {suggested!r}?")) as info:
                select(tiny_gpt2(), selector)
            assert info.value.suggestions == (suggested,)

    @pytest.mark.transformers
    def test_a_glob_star_crosses_dots(self) -> None:
        assert names(gpt2_lm_head(), "transformer.*.mlp") == ["transformer.h.0.mlp", "transformer.h.1.mlp"]

    def test_typo_in_exact_name_suggests_closest(self) -> None:
        with pytest.raises(hs.SelectionError, match="did you mean 'conv1'"):
            select(SmallCNN(), "conv_1")

    @pytest.mark.transformers
    def test_wrapper_prefix_is_recognised(self) -> None:
        # GPT2LMHeadModel names blocks "transformer.h.0"; the bare GPT2Model calls them "h.0".
        with pytest.raises(hs.SelectionError, match=r"did you mean 'h.0.mlp'"):
            select(tiny_gpt2(), "transformer.h.0.mlp")

    def test_index_brackets_are_recognised(self) -> None:
        with pytest.raises(hs.SelectionError, match=r"did you mean 'blocks.0.1'"):
            select(Nested(), "blocks[0][1]")

    def test_without_close_names_lists_top_level(self) -> None:
        with pytest.raises(hs.SelectionError, match="top-level names are conv1, relu, pool, fc"):
            select(SmallCNN(), "zzzzzz")

    def test_type_lists_types_present(self) -> None:
        with pytest.raises(hs.SelectionError, match=r"type LSTM .*matched 0 of 5.*Conv2d"):
            select(SmallCNN(), nn.LSTM)

    def test_foreign_module(self) -> None:
        with pytest.raises(hs.SelectionError, match="not part of this model"):
            select(SmallCNN(), nn.Linear(2, 2))

    def test_predicate_matching_nothing(self) -> None:
        with pytest.raises(hs.SelectionError, match=r"predicate .*matched 0"):
            select(SmallCNN(), lambda name, module: False)

    def test_each_list_member_must_match(self) -> None:
        with pytest.raises(hs.SelectionError, match=r"selector 'fcc' \(in \['conv1', 'fcc'\]\).*did you mean 'fc'"):
            select(SmallCNN(), ["conv1", "fcc"])

    def test_is_a_lookup_error(self) -> None:
        with pytest.raises(LookupError):
            select(SmallCNN(), "nope")


class TestBadSelectors:
    @pytest.mark.parametrize(
        ("selector", "message"),
        [
            (3, "selector 3 \\(int\\) is not usable; expected a module name"),
            ([], "empty list selects nothing"),
            ("re:(unclosed", "not a valid regular expression"),
            (int, "not an nn.Module subclass"),
        ],
    )
    def test_malformed(self, selector: object, message: str) -> None:
        with pytest.raises(hs.SpecError, match=message):
            select(SmallCNN(), selector)  # type: ignore[arg-type]

    def test_not_a_module(self) -> None:
        with pytest.raises(hs.UnsupportedModelError, match=r"expected a torch.nn.Module, got list"):
            select([nn.Linear(2, 2)], "0")  # type: ignore[arg-type]

    def test_module_class_instead_of_instance(self) -> None:
        with pytest.raises(TypeError, match=r"build it first: SmallCNN\(...\)"):
            ensure_module(SmallCNN)

    def test_ensure_module_is_public_and_returns_the_model_itself(self) -> None:
        model = SmallCNN()
        assert hs.ensure_module(model) is model
        scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2)))
        for refused in (scripted, SmallCNN, [model]):
            with pytest.raises(hs.UnsupportedModelError):
                hs.ensure_module(refused)

    def test_a_typo_inside_a_nested_list_is_still_a_typo(self) -> None:
        # hs.capture(model, ["conv1", "fcc"]) hands select a list holding that list
        with pytest.raises(hs.SelectionError, match=r"selector 'fcc' \(in \['conv1', 'fcc'\]\).*did you mean 'fc'"):
            select(SmallCNN(), [["conv1", "fcc"]])
        assert names(SmallCNN(), [["conv1"], ("fc",)]) == ["conv1", "fc"]

    def test_script_module_refused(self) -> None:
        scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2)))
        with pytest.raises(hs.UnsupportedModelError, match=r"TorchScript.*pass the eager module"):
            select(scripted, "0")


# Property: whatever the selector, the result is a subset of named_modules(), in model order.

MODEL = Nested()
NAMED = list(MODEL.named_modules())
NAMES = [name for name, _ in NAMED]


@st.composite
def globs(draw: st.DrawFn, name: str) -> str:
    parts = name.split(".")
    index = draw(st.integers(0, len(parts) - 1))
    parts[index] = draw(st.sampled_from(["*", "?", parts[index][:1] + "*"]))
    return ".".join(parts)


@st.composite
def selectors(draw: st.DrawFn, depth: int = 0) -> hs.Selector:
    name = draw(st.sampled_from([n for n in NAMES if n]))
    choices: list[st.SearchStrategy[hs.Selector]] = [
        st.just(name),
        st.just("re:" + re.escape(name).replace(r"\.", r"\..*", 1)),
        st.sampled_from([nn.Linear, nn.Sequential, nn.GELU, nn.ModuleList, nn.Module]),
        st.just(MODEL.get_submodule(name)),
        st.just(lambda n, m: n.startswith(name[:1])),
        globs(name),
    ]
    if depth < 2:
        choices.append(st.lists(selectors(depth + 1), min_size=1, max_size=3))
    return draw(st.one_of(choices))


@settings(max_examples=150, deadline=None)
@given(selectors())
def test_result_is_subset_of_named_modules_in_model_order(selector: hs.Selector) -> None:
    try:
        result = select(MODEL, selector)
    except hs.SelectionError:
        return  # a list member that matched nothing: refused, which is the rule
    positions = [NAMES.index(name) for name, _ in result]
    assert positions == sorted(set(positions)), "model order, no duplicates"
    for name, module in result:
        assert MODEL.get_submodule(name) is module
    predicate = compile_selector(selector)
    assert [n for n, m in NAMED if predicate(n, m)] == [n for n, _ in result]


def test_the_root_is_selected_by_its_printed_name_too() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + x

    model = Skip()
    assert hs.select(model, "(root)") == hs.select(model, "") == [("", model)]
    listed = str(hs.layers(model, torch.ones(1, 2), ops="(root)")).splitlines()
    assert [line.split()[0] for line in listed if ":op[" in line] == ["(root):op[add#0]"]
