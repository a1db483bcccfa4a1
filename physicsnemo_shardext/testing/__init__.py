"""Testing utilities."""
