"""Tests of the producer library against a real gateway."""
