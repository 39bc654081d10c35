"""CLI argument errors are clear and happen before any model is loaded."""
import pytest

from dflash_ext.cli.main import main


def test_missing_drafter_path_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--drafter", str(tmp_path / "no-such-drafter")])
    assert e.value.code == 2
    assert "no such directory" in capsys.readouterr().err


def test_train_needs_data_and_out(capsys):
    with pytest.raises(SystemExit):
        main(["train"])
    assert "--data" in capsys.readouterr().err


def test_export_converts_dtype(tmp_path):
    import torch

    from dflash_ext import DFlashDrafter
    from dflash_ext.testing.targets import tiny_target_config

    DFlashDrafter.from_target(tiny_target_config(), num_layers=1, block_size=4).save_pretrained(tmp_path / "a")
    main(["export", "--src", str(tmp_path / "a"), "--dst", str(tmp_path / "b"), "--dtype", "bfloat16"])
    b = DFlashDrafter.from_pretrained(str(tmp_path / "b"))
    assert b.fc.weight.dtype == torch.bfloat16
