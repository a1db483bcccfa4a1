"""Tests of physicsnemo_shardext.settings."""

import re
from pathlib import Path

import pytest

from physicsnemo_shardext.settings import ENVIRONMENT_VARIABLES, Settings


def test_defaults():
    assert Settings.from_env({}) == Settings()


def test_all_variables_parse():
    settings = Settings.from_env(
        {
            "SHARDEXT_AUTOLOAD": "off",
            "SHARDEXT_DISABLE": "a,b",
            "SHARDEXT_ONLY": "c",
            "SHARDEXT_STRICT": "yes",
            "SHARDEXT_PREFER": "x, y",
            "SHARDEXT_TRACE": "1",
            "SHARDEXT_SLOW_PLUGIN_SECONDS": "2.5",
        }
    )
    assert settings == Settings(False, ("a", "b"), ("c",), True, ("x", "y"), True, 2.5)
    read_on_import = {
        f"SHARDEXT_{n}" for n in ("AUTOLOAD", "DISABLE", "ONLY", "STRICT", "PREFER", "TRACE", "SLOW_PLUGIN_SECONDS")
    }
    # Read elsewhere: the pytest plugin's timeout, and primitives/compilation.py's handler tracing.
    assert set(ENVIRONMENT_VARIABLES) == read_on_import | {"SHARDEXT_TEST_TIMEOUT", "SHARDEXT_COMPILE_HANDLERS"}


def test_every_variable_the_package_reads_has_a_help_string():
    package = Path(__file__).resolve().parents[1]
    sources = [*(package / "physicsnemo_shardext").rglob("*.py"), *(package / "patches").rglob("*.py")]
    named = {name for path in sources for name in re.findall(r"\bSHARDEXT_[A-Z][A-Z_]*\b", path.read_text())}
    assert named, "the scan found the variables"
    assert named <= set(ENVIRONMENT_VARIABLES), (
        f"read but without a help string: {sorted(named - set(ENVIRONMENT_VARIABLES))}"
    )
    for variable, help_text in ENVIRONMENT_VARIABLES.items():
        assert len(help_text) > 20, f"{variable}: help string too short: {help_text!r}"


@pytest.mark.parametrize("variable", ["SHARDEXT_DISABLE", "SHARDEXT_ONLY"])
def test_plugin_list_help_says_unknown_names_warn(variable):
    assert "matches no installed plugin or distribution" in ENVIRONMENT_VARIABLES[variable]
    assert "ShardextWarning" in ENVIRONMENT_VARIABLES[variable]


def test_bad_boolean_names_the_variable():
    with pytest.raises(ValueError, match="SHARDEXT_STRICT='maybe'"):
        Settings.from_env({"SHARDEXT_STRICT": "maybe"})


def test_strict_description_covers_incompatible_plugins():
    assert "incompatible" in ENVIRONMENT_VARIABLES["SHARDEXT_STRICT"]


@pytest.mark.parametrize(
    "variable,field",
    [("SHARDEXT_DISABLE", "deny"), ("SHARDEXT_ONLY", "allow"), ("SHARDEXT_PREFER", "prefer")],
)
def test_renamed_plugins_keep_their_old_names(variable, field):
    settings = Settings.from_env({variable: "misc_ops,spectral"})
    assert getattr(settings, field) == ("layout_ops", "indexing_einsum")


@pytest.mark.parametrize(("value", "seconds"), [("", 1.0), ("0.25", 0.25), ("0", 0.0), ("off", None), ("None", None)])
def test_slow_plugin_threshold_parses(value, seconds):
    assert Settings.from_env({"SHARDEXT_SLOW_PLUGIN_SECONDS": value}).slow_plugin_seconds == seconds


@pytest.mark.parametrize("value", ["-1", "fast", "nan"])
def test_bad_slow_plugin_threshold_names_the_variable(value):
    with pytest.raises(ValueError, match=f"SHARDEXT_SLOW_PLUGIN_SECONDS='{value}' is not a number of seconds"):
        Settings.from_env({"SHARDEXT_SLOW_PLUGIN_SECONDS": value})
