"""The vLLM plugin's selection (spherical_kv_vllm): off unless SPHERICAL_KV_TIER is set, and
errors that name the variable. Needs no vLLM: the entry point imports it only when on."""
import pytest

import spherical_kv_vllm as plugin
from spherical_kv_ref.codec import BITS


def test_off_without_a_tier(monkeypatch):
    for name in (plugin.TIER_ENV, plugin.CODEBOOK_ENV, plugin.SEED_ENV):
        monkeypatch.delenv(name, raising=False)
    assert plugin.settings() is None
    plugin.register()                 # returns before importing vLLM
    monkeypatch.setenv(plugin.TIER_ENV, "  ")
    assert plugin.settings() is None


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv(plugin.TIER_ENV, "4/2")
    monkeypatch.delenv(plugin.CODEBOOK_ENV, raising=False)
    monkeypatch.delenv(plugin.SEED_ENV, raising=False)
    assert plugin.settings() == ((4, 2), "uniform", 0)
    monkeypatch.setenv(plugin.CODEBOOK_ENV, "lloyd-max")
    monkeypatch.setenv(plugin.SEED_ENV, "7")
    assert plugin.settings() == ((4, 2), "lloyd-max", 7)
    monkeypatch.setenv(plugin.TIER_ENV, "default")
    assert plugin.settings() == (plugin.DEFAULT_TIER, "lloyd-max", 7)


@pytest.mark.parametrize("name,value,match", [
    ("SPHERICAL_KV_TIER", "4", "SPHERICAL_KV_TIER"), ("SPHERICAL_KV_TIER", "5/4", "bits"),
    ("SPHERICAL_KV_CODEBOOK", "nf4", "SPHERICAL_KV_CODEBOOK"),
    ("SPHERICAL_KV_SEED", "x", "SPHERICAL_KV_SEED")])
def test_bad_settings_name_the_variable(monkeypatch, name, value, match):
    monkeypatch.setenv(plugin.TIER_ENV, "4/4")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        plugin.settings()


def test_tier_parsing():
    assert plugin.parse_tier(" 16/16") == (16, 16)
    assert plugin.parse_tier(" default ") == plugin.DEFAULT_TIER == (8, 4)
    assert plugin.BITS == BITS
    for bad in ("4", "4/5", "a/b", "4/4/4", "", "auto"):
        with pytest.raises(ValueError, match="tier"):
            plugin.parse_tier(bad)
