"""Fake providers for the tests."""
