"""Check a plugin's declared version ranges against what is installed.

Examples:
    >>> incompatibility({"torch": ">=1.0"}) is None
    True
    >>> incompatibility({"torch": "<1.0"})  # doctest: +ELLIPSIS
    'requires torch<1.0, but torch ... is installed'

A pre-release counts as its release, so NVIDIA's ``2.14.0a0+<hash>.nv26.08`` meets ``torch>=2.14``.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["incompatibility", "installed_version"]

_ALIASES = {"physicsnemo": "nvidia-physicsnemo"}


def installed_version(distribution: str) -> str | None:
    """Version string of an installed distribution, or ``None``."""
    try:
        return metadata.version(_ALIASES.get(distribution, distribution))
    except metadata.PackageNotFoundError:
        return None


def incompatibility(requirements: Mapping[str, str]) -> str | None:
    """Return why ``requirements`` are not met, or ``None`` when they all are.

    Raises:
        ValueError: a requirement is not a valid PEP 440 specifier (the plugin is then invalid).
    """
    if not isinstance(requirements, Mapping):
        raise ValueError(f"shardext_requirements must return a mapping, got {type(requirements).__name__}")
    for distribution, specifier_text in requirements.items():
        try:
            specifier = SpecifierSet(str(specifier_text))
        except InvalidSpecifier:
            raise ValueError(f"invalid version specifier {specifier_text!r} for {distribution}") from None
        name = _ALIASES.get(distribution, distribution)
        version = installed_version(name)
        if version is None:
            return f"requires {name}{specifier}, which is not installed"
        try:
            parsed = Version(version)
        except InvalidVersion:
            return f"requires {name}{specifier}, but the installed version {version!r} cannot be parsed"
        # Compare the release: a local tag such as "+cu126" must not decide compatibility, and
        # NVIDIA's container builds (torch "2.14.0a0+<hash>.nv26.08") carry the release's code.
        if not specifier.contains(Version(parsed.base_version), prereleases=True):
            return f"requires {name}{specifier}, but {name} {version} is installed"
    return None
