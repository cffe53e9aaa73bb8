"""A profile is reused across run directories when its declared inputs are the same (issue 37, item 2).

The profile stage keys a shared cache (``<cache_dir>/profiles/<key>``, else ``$ACN_PROFILE_CACHE``,
else ``~/.cache/autocompress-nemo/profiles``) on the engine (name, version, dtype, threads,
settings), the device, the workload, the parent and the option grid. Two run directories with the
same inputs profile once, in the real llama.cpp engine on the tiny model; changing one declared
input profiles again. Every declared input is checked to change the key (no profiling needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autocompress_nemo.profile.stage as stage
from autocompress_nemo.config.entry import compose

BASE = ["+target=tiny_cpu", "model=tiny_llama", "search=quick"]


def _cfg(tmp: Path, *extra: str):
    return compose([*BASE, f"cache_dir={tmp / 'cache'}", f"run_dir={tmp / 'run'}", *extra])


@pytest.mark.engine
def test_a_second_run_directory_reuses_the_profile_and_a_changed_input_reprofiles(tmp_path, monkeypatch, capsys):
    pytest.importorskip("llama_cpp")
    calls: list[str] = []
    real = stage.build_table

    def counting(engine, parent, wl, **kw):
        calls.append(f"{engine.name} {wl}")
        return real(engine, parent, wl, **kw)

    monkeypatch.setattr(stage, "build_table", counting)
    cfg = _cfg(tmp_path)
    first = stage.run_profile(cfg, tmp_path / "run1")
    assert len(calls) == 1
    shared = tmp_path / "cache" / "profiles" / stage.profile_cache_key(cfg)
    assert (shared / "cost_table.json").is_file()
    second = stage.run_profile(cfg, tmp_path / "run2")
    assert len(calls) == 1, "the second run directory profiled again"
    assert json.loads(second.read_text()) == json.loads(first.read_text())
    assert "reusing the shared profile" in capsys.readouterr().err
    stage.load_table(cfg, second)  # a valid table for this target

    changed = _cfg(tmp_path, "target.workload.output_len=6")
    third = stage.run_profile(changed, tmp_path / "run3")
    assert len(calls) == 2, "a changed workload reused the old profile"
    assert json.loads(third.read_text())["provenance"]["workload"]["output_len"] == 6


@pytest.mark.parametrize(
    "override",
    [
        "target.engine.dtype=f32",  # dtype
        "target.engine.threads=2",  # engine setting
        "target.engine.repeats=7",  # profiling setting
        "target.engine.settings.rounds=3",  # profiling setting
        "target.workload.input_len=48",  # workload
        "target.hardware.name=other_cpu",  # device
        "model=tiny_hybrid",  # parent
        "search.ffn_options=3",  # option grid
        "engine@target.engine=torch_eager_cpu",  # engine
    ],
)
def test_every_declared_input_changes_the_key(tmp_path, override: str) -> None:
    pytest.importorskip("llama_cpp")
    base = stage.profile_cache_key(_cfg(tmp_path))
    assert stage.profile_cache_key(_cfg(tmp_path, override)) != base
    assert stage.profile_cache_key(_cfg(tmp_path, "seed=7")) == base  # not a profile input


def test_where_the_shared_profiles_live(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(stage.PROFILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    no_cache_dir = compose([*BASE, f"run_dir={tmp_path / 'run'}"])
    assert stage.shared_profiles_dir(no_cache_dir) == tmp_path / "xdg" / "autocompress-nemo" / "profiles"
    assert stage.shared_profiles_dir(_cfg(tmp_path)) == tmp_path / "cache" / "profiles"
    monkeypatch.setenv(stage.PROFILE_CACHE_ENV, str(tmp_path / "env"))
    assert stage.shared_profiles_dir(no_cache_dir) == tmp_path / "env"
    monkeypatch.setenv(stage.PROFILE_CACHE_ENV, "off")
    assert stage.shared_profiles_dir(_cfg(tmp_path)) is None
