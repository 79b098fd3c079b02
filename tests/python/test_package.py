"""The package around the ops: its version, and the check that the extension matches the running torch."""
import re
import types

import pytest
import torch

import fuseforge
from fuseforge import _library


def test_version_is_set():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fuseforge.__version__)


def test_extension_built_for_another_torch_names_both_and_how_to_rebuild(monkeypatch):
    fake = types.ModuleType("fuseforge._build_info")
    fake.TORCH_VERSION = "2.99.0+cu999"
    monkeypatch.setitem(__import__("sys").modules, "fuseforge._build_info", fake)
    monkeypatch.delenv("FUSEFORGE_EXTENSION", raising=False)
    with pytest.raises(ImportError, match=r"built against torch 2\.99\.0\+cu999, but torch .* is running") as e:
        _library.load()
    assert torch.__version__ in str(e.value) and "Rebuild" in str(e.value)


def test_matching_or_unrecorded_build_loads():
    _library.check_build(torch.__version__)
    _library.check_build(None)
