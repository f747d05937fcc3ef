"""describe()'s environment: the optional packages that decide which paths can run are listed with their versions."""

import importlib.metadata

import diffusers_h3


def test_environment_lists_optional_packages(monkeypatch):
    env = diffusers_h3.describe()["environment"]
    assert env["optional_packages"]["peft"] == importlib.metadata.version("peft")
    real = importlib.metadata.version

    def version(name):
        if name == "flashinfer-python":
            raise importlib.metadata.PackageNotFoundError(name)
        if name == "av":
            return "99.0"
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    optional = diffusers_h3.describe()["environment"]["optional_packages"]
    assert optional["flashinfer-python"] is None and optional["av"] == "99.0"
