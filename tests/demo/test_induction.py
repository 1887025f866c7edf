"""The induction demo: its data generator, its shipped weights, and the script that makes them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors import safe_open
from safetensors.torch import load_file

from hookscope.demo.induction import (
    BOS,
    STEPS,
    VOCAB,
    WEIGHTS_FILE,
    build_induction_model,
    load_induction_model,
    main,
    make_repeats,
    repeat_loss,
    train,
)
from hookscope.errors import SpecError

pytestmark = pytest.mark.transformers

# Training draws its batches from seeds 1 ... STEPS; this one is none of them.
HOLDOUT_SEED = 987_654_321


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as file:
        metadata: dict[str, str] = file.metadata()
    return metadata


def test_rows_hold_a_segment_repeated_to_the_end() -> None:
    ids, predictable = make_repeats(50, seed=3, length=24, period=(3, 12))
    assert ids.shape == predictable.shape == (50, 25)
    assert ids.dtype == torch.int64
    assert (ids[:, 0] == BOS).all()
    assert ((ids[:, 1:] >= 1) & (ids[:, 1:] < VOCAB)).all()
    for row, marks in zip(ids, predictable, strict=True):
        first = int(marks.nonzero()[0])  # the second copy's second token
        assert marks[first:].all()
        repeats = [
            p for p in range(3, min(12, first - 1) + 1) if torch.equal(row[first - 1 :], row[first - 1 - p : -p])
        ]
        assert repeats, "from the second copy on, every token repeats the token one period earlier"


def test_a_fixed_period_as_long_as_half_the_row_is_bos_a_a() -> None:
    ids, predictable = make_repeats(8, seed=0, length=10, period=5)
    assert torch.equal(ids[:, 1:6], ids[:, 6:])
    assert predictable[:, 7:].all()
    assert not predictable[:, :7].any()


def test_same_seed_same_rows_and_global_rng_untouched() -> None:
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    first = make_repeats(64, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    second = make_repeats(64, seed=5)
    other = make_repeats(64, seed=6)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize(("count", "length", "period"), [(-1, 32, 4), (4, 8, 5), (4, 32, (6, 3)), (4, 32, 0)])
def test_bad_arguments_are_refused(count: int, length: int, period: int | tuple[int, int]) -> None:
    with pytest.raises(SpecError, match="expected count >= 0"):
        make_repeats(count, seed=0, length=length, period=period)


def test_repeat_loss_refuses_a_mark_on_the_first_token() -> None:
    ids, predictable = make_repeats(2, seed=0)
    predictable[:, 0] = True
    with pytest.raises(SpecError, match="column 0"):
        repeat_loss(torch.zeros(2, ids.shape[1], VOCAB), ids, predictable)


def test_shipped_weights_load_in_eval_mode_and_are_small() -> None:
    model = load_induction_model()
    assert all(not module.training for module in model.modules())
    data = resources.files("hookscope.demo").joinpath(WEIGHTS_FILE).read_bytes()
    assert len(data) < 1_000_000
    with resources.as_file(resources.files("hookscope.demo").joinpath(WEIGHTS_FILE)) as path:
        metadata = read_metadata(path)
    assert metadata["seed"] == "0"
    assert metadata["steps"] == str(STEPS)


def test_shipped_weights_predict_the_repeat_and_not_the_random_tokens() -> None:
    """The trained property itself, with plain torch: the second copy of ``BOS A A`` is predicted
    far better than chance, the first copy no better."""
    period = 16
    ids, _ = make_repeats(200, seed=HOLDOUT_SEED, length=2 * period, period=period)
    with torch.no_grad():
        logits = load_induction_model()(ids).logits
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # token t + 1
    first_copy = losses[:, 1:period].mean().item()  # tokens 2 ... period
    second_copy = losses[:, period + 1 :].mean().item()  # tokens period + 2 ... 2 * period
    assert second_copy < 1.0  # uniform guessing scores log(31) = 3.43
    assert first_copy > 3.0
    assert second_copy < first_copy / 4


def test_a_short_training_run_is_deterministic_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    lines: list[str] = []
    first, loss = train(seed=3, steps=3, write=lines.append)
    second, again = train(seed=3, steps=3, write=lambda line: None)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.get_num_threads() == threads
    assert loss == again
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(first.state_dict()[name], second.state_dict()[name]) for name in first.state_dict())
    assert not first.training
    assert lines[0].startswith("step 3/3")
    assert lines[-1].startswith("mean loss of the last 3 steps")
    other, _ = train(seed=4, steps=3, write=lambda line: None)
    assert not torch.equal(
        other.state_dict()["transformer.h.0.attn.c_attn.weight"],
        first.state_dict()["transformer.h.0.attn.c_attn.weight"],
    )


def test_main_writes_a_loadable_file_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "weights" / "model.safetensors"
    assert main(["--out", str(out), "--steps", "2", "--seed", "4"]) == 0
    assert [path.name for path in out.parent.iterdir()] == [out.name]
    metadata = read_metadata(out)
    assert (metadata["seed"], metadata["steps"]) == ("4", "2")
    assert float(metadata["final_loss"]) > 0
    build_induction_model().load_state_dict(load_file(out))
    assert f"wrote {out}" in capsys.readouterr().out


def test_main_refuses_zero_steps(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.safetensors"), "--steps", "0"])
    assert list(tmp_path.iterdir()) == []
