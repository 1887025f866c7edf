"""DDP and FSDP2 on 2 CPU processes (gloo): names, captures per rank, gradient statistics.

One spawn runs every check (tests/dist_targets.py); each test reads its part of the results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dist_targets import close, every_check
from tests.distributed import run_ranks

# The ranks build a GPT-2 too (one spawn runs every check).
pytestmark = [
    pytest.mark.skipif(
        not __import__("torch").distributed.is_available(), reason="this torch has no torch.distributed"
    ),
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.transformers,
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder: Path = tmp_path_factory.mktemp("ranks")
    return run_ranks(every_check, folder, str(folder))


def test_store_statistics_merged_across_ranks_equal_one_process_bit_for_bit(
    ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    import numpy as np

    import hookscope as hs
    from tests.dist_targets import extract_stats

    one = extract_stats(0, 1, str(tmp_path / "one.zarr"))
    assert ranks[0]["extract_stats"] == ranks[1]["extract_stats"] == one  # merged in chunk order, whoever wrote
    values = hs.open_store(tmp_path / "one.zarr")["0"][:].astype(np.float64)
    assert one["stats"]["0"]["count"] == 70
    assert one["stats"]["0"]["mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert one["stats"]["0"]["std"] == pytest.approx(values.std(), rel=1e-12)


def test_ddp_names_have_no_module_prefix_and_both_spellings_select(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["ddp_names_and_captures"]
        assert found["layers"] == ["", "module", "0", "1", "1.0", "1.1", "2", "2.0", "2.1", "3"]
        assert found["sites"] == ["1.0#0:output", "3#0:output"]
        assert found["short_equal"]
        assert found["long_spelling_reads"]
        assert found["trace_names"][:3] == ["", "module", "0"]


def test_ddp_captures_each_ranks_own_batch(ranks: list[dict[str, Any]]) -> None:
    assert all(rank["ddp_gpt2"]["block_equal"] and rank["ddp_gpt2"]["logits_equal"] for rank in ranks)
    assert ranks[0]["ddp_gpt2"]["sites"] == ["lm_head#0:output", "transformer.h.1#0:output"]


def test_ddp_parameter_gradients_are_read_after_the_all_reduce(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["ddp_gradients_are_the_averaged_ones"]
        assert close((found["norm"], found["averaged"]))
        assert not close((found["norm"], found["local"]))  # the ranks' batches differ
    first, second = (rank["ddp_gradients_are_the_averaged_ones"]["norm"] for rank in ranks)
    assert close((first, second))


def test_ddp_monitor_logs_the_averaged_gradients_under_the_models_own_names(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["ddp_monitor"]
        assert close((found["norm"], found["averaged"]))
        assert found["names"] == ["grad/norm/1", "grad/norm/2"]


def test_fsdp2_captures_the_ranks_batch(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["fsdp2"]
        assert "FSDPSequential" in found["classes"]
        assert found["sites"] == ["1#0:output", "2.0#0:output", "3#0:output"]
        assert found["block_equal"]
        assert found["out_equal"]


def test_fsdp2_parameter_statistics_see_whole_weights(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        found = rank["fsdp2"]
        assert found["sharded"] == "DTensor"
        assert found["local_rows"] == 4  # the rank holds half of the (8, 8) weight
        assert found["params_counted"] == found["params_plain"]
        assert close(found["grad_norm"])
        assert close(found["ratio"])
        assert close(found["stats_mean"])
        assert found["stats_count"][0] == found["stats_count"][1] == 64
