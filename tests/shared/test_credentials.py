"""Credentials never shown, and nothing else hidden: one rule for messages, reprs, records and the CLI.

A secret is the value of an option named for one (``secret``, ``token``, ``aws_secret_access_key``),
a URL's ``user:password@`` (shown ``***@``) or a secret query value (``X-Amz-Signature=***``);
every other value is shown as given. The expected texts are written out here by hand.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from tests.cli.test_cli import run_cli

SECRET = "Sup3rSecretValue9"
#: A URL with credentials in its user information and a presigned query, and as it must be shown.
URL = f"memory://AKIAHOOK:{SECRET}@{{bucket}}/f.zarr?X-Amz-Signature={SECRET}&X-Amz-Date=20250101"
SHOWN = "memory://***@{bucket}/f.zarr?X-Amz-Signature=***&X-Amz-Date=20250101"


def cnn_extract(out: str, *extra: str) -> list[str]:
    return ["extract", "demo:cnn", "--data", "random:8:3x32x32", "-l", "fc", "-o", out, *extra]


@pytest.mark.parametrize(
    ("option", "shown"),
    [("secret:" + SECRET, "'secret:***'"), (SECRET, "'***'"), ("=" + SECRET, "'=***'")],
    ids=["colon-for-equals", "value-alone", "no-key"],
)
def test_a_malformed_storage_option_is_refused_without_its_value(
    option: str, shown: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, *cnn_extract(str(tmp_path / "f.zarr"), "--storage-option", option))
    assert code == 2, err
    assert SECRET not in out + err
    assert f"--storage-option {shown} is not KEY=VALUE" in err


def test_a_config_shows_no_credentials_written_into_an_option_url() -> None:
    options = {
        "endpoint_url": f"http://minio:{SECRET}@127.0.0.1:9000",
        "client_kwargs": {"proxies": [f"http://proxy-user:{SECRET}@10.0.0.1:3128"], "region_name": "eu"},
        "secret": SECRET,
        "profile": "local",
    }
    config = hs.ExtractConfig(storage_options=options)
    for text in (repr(config), str(config.to_dict())):
        assert SECRET not in text
        assert "'endpoint_url': 'http://***@127.0.0.1:9000'" in text
        assert "'proxies': ['http://***@10.0.0.1:3128']" in text
        assert "'secret': '***'" in text
        assert "'profile': 'local'" in text  # names a profile, not who you are


def test_options_that_are_not_secrets_leave_a_message_whole(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = cnn_extract(str(tmp_path / "z.zarr"), "--storage-option", "profile=local", "--storage-option", "anon=true")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "is a local path" in err
    assert "drop them for a local path" in err
    assert "***" not in err


def test_a_token_holding_a_secret_is_replaced_whole_and_ordinary_words_are_kept() -> None:
    from hookscope import redaction  # the rule the command line applies to the errors it prints

    secrets = redaction.secrets_of(options={"password": "hunter2", "token": "pw", "profile": "local"})
    text = "sig%3Dhunter2x, hunter and hunter2 in a local pwd, kept locally (pw)"
    assert redaction.scrub(text, secrets) == "sig%***, hunter and *** in a local pwd, kept locally (***)"


def test_one_rule_for_a_url_in_messages_records_reprs_and_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bucket = f"cred-{uuid.uuid4().hex[:8]}"  # the memory file system lives as long as the process
    url, shown = URL.format(bucket=bucket), SHOWN.format(bucket=bucket)
    with pytest.raises(hs.StoreError) as refused:  # nothing there yet
        hs.open_store(url)
    assert f"{shown!r} holds nothing" in str(refused.value)

    command = f"python run.py -o '{url}' --storage-option profile=dev --hf-token {SECRET}"
    recorded = f"python run.py -o '{shown}' --storage-option profile=dev --hf-token '***'"
    assert f"command={recorded!r}" in repr(hs.ExtractConfig(command=command))
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    store = hs.extract(model, torch.randn(8, 4), tmp_path / "f.zarr", layers="0", command=command, progress=False)
    assert store.meta["command"] == recorded

    code, out, err = run_cli(capsys, *cnn_extract(url))  # the store's repr (the library), its done line (the CLI)
    assert code == 0, err
    assert SECRET not in out + err
    assert out.startswith(f"<Store {shown}: 8 rows")
    assert f"wrote 8 rows of 1 site to {shown} in " in out
