"""Packaging beside pyproject.toml, for the one thing it cannot say: the repository's ``recipes/`` folder ships inside
the package as ``lorarl/recipes/`` (pyproject's ``packages.find`` cannot add a package mapped from another folder).
``recipes/`` stays the source the README, the docs and the tests name; ``lorarl.config.shipped`` finds the recipes
in either place. tests/test_packaging.py builds the wheel and trains from it in a clean environment."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["lorarl*"]) + ["lorarl.recipes"],
    package_dir={"lorarl.recipes": "recipes"},
)
