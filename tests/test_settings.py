"""Tests of physicsnemo_shardext.settings."""

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
        }
    )
    assert settings == Settings(False, ("a", "b"), ("c",), True, ("x", "y"), True)
    assert set(ENVIRONMENT_VARIABLES) == {f"SHARDEXT_{n}" for n in ("AUTOLOAD", "DISABLE", "ONLY", "STRICT", "PREFER", "TRACE")}


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
