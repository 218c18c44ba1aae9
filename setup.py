"""Shim so that `pip install -e .` works with older pip/setuptools; metadata lives in pyproject.toml."""

from setuptools import setup

setup()
