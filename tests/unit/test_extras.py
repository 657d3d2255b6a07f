"""A feature whose optional dependencies are missing names the extra that brings them."""

from __future__ import annotations

import pytest

from pagedinfer.entrypoints.cli import main
from pagedinfer.extras import MissingExtraError, missing_modules, require_extra
from pagedinfer.structured_output import backend


def test_missing_module_names_the_extra() -> None:
    assert missing_modules("json", "no_such_module_xyz") == ["no_such_module_xyz"]
    require_extra("serve", "json", feature="nothing")  # installed: no error
    with pytest.raises(MissingExtraError, match=r"pip install 'pagedinfer\[serve\]'"):
        require_extra("serve", "no_such_module_xyz", feature="pagedinfer serve")


def test_guided_backend_without_its_library_is_a_value_error(monkeypatch) -> None:
    monkeypatch.setitem(backend._BACKEND_LIBRARIES, "xgrammar", "no_such_module_xyz")
    with pytest.raises(ValueError, match=r"pagedinfer\[guided\]"):
        backend.require_backend_library("xgrammar")
    backend.require_backend_library("guidance")  # llguidance is installed


def test_cli_prints_one_line_for_a_missing_extra(monkeypatch, capsys) -> None:
    import pagedinfer.extras as extras

    real = extras.missing_modules
    monkeypatch.setattr(
        extras, "missing_modules", lambda *m: ["uvicorn"] if "uvicorn" in m else real(*m)
    )
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'pagedinfer[serve]'" in err and "Traceback" not in err
