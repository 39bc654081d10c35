"""CLI argument errors are clear and happen before any model is loaded."""
import pytest

from dflash_ext.__main__ import main


def test_missing_drafter_path_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--drafter", str(tmp_path / "no-such-drafter")])
    assert e.value.code == 2
    assert "no such directory" in capsys.readouterr().err


def test_train_needs_data_and_out(capsys):
    with pytest.raises(SystemExit):
        main(["train"])
    assert "--data" in capsys.readouterr().err
