"""The deployment tests: one deployment (conftest.py) for every module here."""
